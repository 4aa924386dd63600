"""Attention: one entry point, implementation chosen from config plus platform.

'xla' is the reference path everywhere; 'cudnn' is the fused flash-attention kernel on NVIDIA GPUs.
Inputs carry global positions (the program is written for the global array), so causal masks stay
correct when the sequence axis is sharded: keys and values are gathered over the sequence shards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtron.config import ConfigError
from jaxtron.sharding import constrain

Q_AXES = ("activation_batch", "activation_length", "activation_heads", "activation_head_dim")
KV_AXES = ("activation_batch", "activation_kv_length", "activation_kv_heads", "activation_head_dim")


def resolve_implementation(choice: str, dtype: jnp.dtype, backend: str | None = None) -> str:
    """'auto' -> 'cudnn' on GPU for 16-bit compute, else 'xla'. 'cudnn' off GPU is a ConfigError."""
    backend = backend or jax.default_backend()
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if choice == "auto":
        return "cudnn" if backend == "gpu" and half else "xla"
    if choice == "cudnn" and (backend != "gpu" or not half):
        raise ConfigError(f"config field 'model.attention' is 'cudnn' but the backend is {backend} with compute "
                          f"dtype {jnp.dtype(dtype).name}; cuDNN needs a GPU and bfloat16/float16, so use 'auto' or 'xla'.")
    return choice


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: str = "xla",
                          segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention.

    q: [batch, length, heads, head_dim]; k, v: [batch, length, kv_heads, head_dim] with kv_heads
    dividing heads (keys/values are never repeated in memory). segment_ids: optional [batch, length]
    document ids; tokens attend only within their own document.
    """
    q = constrain(q, Q_AXES)
    k = constrain(k, KV_AXES)
    v = constrain(v, KV_AXES)
    mask = None
    if segment_ids is not None:
        mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)
    return constrain(out, Q_AXES)
