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


def cudnn_unsupported(dtype: jnp.dtype, head_dim: int, sequence_shards: int, backend: str) -> str | None:
    """Why JAX's cuDNN flash attention cannot run this configuration, or None when it can."""
    if backend != "gpu":
        return f"the backend is {backend}, not a GPU"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"compute dtype {jnp.dtype(dtype).name} is not 16-bit"
    if head_dim % 8 or head_dim > 128:
        return f"head_dim {head_dim} is not a multiple of 8 up to 128"
    if sequence_shards > 1:  # JAX's cuDNN partitioner refuses a sharded sequence axis
        return f"the sequence is sharded {sequence_shards} ways (mesh.sequence)"
    return None


def resolve_implementation(choice: str, dtype: jnp.dtype, head_dim: int = 128, sequence_shards: int = 1,
                           backend: str | None = None) -> str:
    """'auto' -> 'cudnn' where JAX's cuDNN kernel supports the configuration, else 'xla'.

    An explicit 'cudnn' that cannot run is a ConfigError naming the reason.
    """
    reason = cudnn_unsupported(dtype, head_dim, sequence_shards, backend or jax.default_backend())
    if choice == "auto":
        return "xla" if reason else "cudnn"
    if choice == "cudnn" and reason:
        raise ConfigError(f"config field 'model.attention' is 'cudnn' but {reason}; use 'auto' or 'xla'.")
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
