"""Parallelism: the device mesh, the rules table that maps logical axes onto it, and how processes join a run."""
