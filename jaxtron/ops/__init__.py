"""Kernels chosen in one place: attention implementations and matmul precision."""
