"""Configuration: the schema (frozen, self-validating dataclasses) and the loader (config files, overrides)."""
