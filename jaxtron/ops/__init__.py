"""Kernels chosen in one place: attention (``attention.py`` dispatches to the XLA reference, cuDNN flash attention,
the blockwise kernel and cuDNN by chunks on a sharded sequence) and FP8 projections (``fp8.py``). Models call
``attention.dot_product_attention`` and ``fp8.projection``; the expert GEMM is ``jax.lax.ragged_dot`` in
``models/moe.py``."""
