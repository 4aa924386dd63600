"""Choosing a mesh before spending GPU hours: an analytic estimate, and a dry run of the real compiled step."""
