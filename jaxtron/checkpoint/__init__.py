"""Checkpoints: train states (orbax), parameter-only stores and the checksums both are verified against."""
