"""jaxtron: JAX/XLA SPMD training of large language models."""

__version__ = "0.1.0"
