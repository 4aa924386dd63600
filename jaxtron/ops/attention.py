"""Attention: one entry point, implementation chosen from config plus platform.

'xla' is the reference path everywhere (whole score matrices); 'cudnn' is the fused flash-attention kernel on
NVIDIA GPUs; 'blockwise' is flash-style attention written in XLA (``ops/blockwise.py``), which 'auto' takes when
the sequence axis is sharded (context parallelism): each device keeps its queries and gathers the keys and
values of the whole sequence, and no [length, length] matrix is held. An explicit 'cudnn' on a sharded sequence
runs cuDNN on those gathered keys by chunks (``ops/chunked.py``): a few calls per chunk of queries, shaped by
lengths, merged by their softmax statistics.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxtron.config.schema import ConfigError
from jaxtron.parallel.sharding import constrain, logical_to_spec, spec_axes

OUTPUT_NAME = "attention_out"  # checkpoint name of the attention output (remat policies can keep it)
Q_AXES = ("activation_batch", "activation_length", "activation_heads", "activation_head_dim")
KV_AXES = ("activation_batch", "activation_kv_length", "activation_kv_heads", "activation_head_dim")
KV_SHARDED_AXES = ("activation_batch", "activation_length", "activation_kv_heads", "activation_head_dim")


def cudnn_unsupported(dtype: jnp.dtype, head_dim: int, sequence_shards: int, backend: str) -> str | None:
    """Why JAX's cuDNN flash attention cannot run this configuration, or None when it can."""
    if backend != "gpu":
        return f"the backend is {backend}, not a GPU"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"compute dtype {jnp.dtype(dtype).name} is not 16-bit"
    if head_dim % 8 or head_dim > 128:
        return f"head_dim {head_dim} is not a multiple of 8 up to 128"
    return None


def resolve_implementation(choice: str, dtype: jnp.dtype, head_dim: int = 128, sequence_shards: int = 1,
                           backend: str | None = None) -> str:
    """'auto' -> 'blockwise' when the sequence is sharded, else 'cudnn' where JAX's cuDNN kernel supports the
    configuration and 'xla' where it does not. (On a sharded sequence cuDNN runs by chunks only when asked for,
    until a GPU has measured it against the blockwise kernel.)

    An explicit 'cudnn' that cannot run is a ConfigError naming the reason.
    """
    reason = cudnn_unsupported(dtype, head_dim, sequence_shards, backend or jax.default_backend())
    if choice == "auto":
        return "blockwise" if sequence_shards > 1 else ("xla" if reason else "cudnn")
    if choice == "cudnn" and reason:
        raise ConfigError(f"config field 'execution.attention' is 'cudnn' but {reason}; use 'auto' or 'xla'.")
    return choice


def cpu_implementation(choice: str, dtype: jnp.dtype, head_dim: int, sequence_shards: int) -> str:
    """The attention a CPU compile of a config runs (the dry run, and the planner's estimate of that program):
    ``choice`` resolved for the CPU, an explicit 'cudnn' taken as 'auto' since it cannot compile there."""
    return resolve_implementation("auto" if choice == "cudnn" else choice, dtype, head_dim, sequence_shards,
                                  backend="cpu")


def _sequence_axes() -> tuple[str, ...]:
    """The mesh axes of more than one device that split the queries' sequence (none outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(a for a in spec_axes(logical_to_spec(Q_AXES), 1) if mesh.shape[a] > 1)


def segment_layout(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """Packed rows as cuDNN's ragged attention wants them: [batch, M] document lengths and [batch, M+1]
    document start offsets (the last one the row's end), both padded with -1, M = ``max_segments``.

    ``segment_ids`` [batch, length] numbers the documents of each row 1, 2, ... in order (jaxtron's loader);
    a row of more than M documents must be refused before it gets here (the loader does, see
    ``check_segments``): its extra documents would be left out of the layout.
    """
    batch, length = segment_ids.shape
    starts = jnp.concatenate([jnp.ones((batch, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    first = jnp.sort(jnp.where(starts, jnp.arange(length), length), axis=1)  # starts, then `length`s
    if first.shape[1] < max_segments + 1:
        first = jnp.pad(first, ((0, 0), (0, max_segments + 1 - first.shape[1])), constant_values=length)
    bounds = first[:, :max_segments + 1]  # the c document starts in order, then `length` repeated
    count = jnp.sum(starts, axis=1, keepdims=True)  # documents per row
    j = jnp.arange(max_segments + 1)[None, :]
    offsets = jnp.where(j <= count, bounds, -1).astype(jnp.int32)
    lengths = jnp.where(j[:, :-1] < count, bounds[:, 1:] - bounds[:, :-1], -1).astype(jnp.int32)
    return lengths, offsets


def _cudnn_packed(q, k, v, segment_ids, max_segments: int) -> jax.Array:
    """cuDNN flash attention over packed documents: each document is its own causal sequence inside the
    kernel (ragged offsets), so no [length, length] mask is built and nothing attends across documents."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # JAX exposes offsets only here

    lengths, offsets = segment_layout(segment_ids, max_segments)
    return cudnn.dot_product_attention(
        q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
        scale=1.0 / math.sqrt(q.shape[-1]), mask_type=cudnn.MaskType.PADDING_CAUSAL, qkv_layout="BTNH")


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: str = "xla",
                          segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                          max_segments: int = 64) -> jax.Array:
    """Causal grouped-query attention.

    q: [batch, length, heads, head_dim]; k, v: [batch, length, kv_heads, head_dim] with kv_heads
    dividing heads (keys/values are never repeated in memory). segment_ids: optional [batch, length]
    document ids; tokens attend only within their own document. With them, ``positions`` [batch, length] (each
    token's position in its document) decide causality, so the columns may hold the tokens in any order (the
    loader's load-balanced layout of a sharded sequence); without them, the column order is the token order.
    With cuDNN, packed documents go to the kernel as per-document lengths and offsets (at most ``max_segments``
    per row); on a sharded sequence it runs by chunks of the loader's layout, which needs the segment ids and
    positions.
    """
    q = constrain(q, Q_AXES)
    chunks = implementation == "cudnn" and bool(_sequence_axes())
    if chunks and (segment_ids is None or positions is None):
        raise ValueError("cuDNN attention on a sharded sequence needs the loader's segment ids and positions")
    # blockwise attention gathers the keys and values itself, inside its shard_map: they enter it sharded like
    # the queries (gathering them here as well would gather twice)
    kv_axes = KV_SHARDED_AXES if implementation == "blockwise" or chunks else KV_AXES
    k = constrain(k, kv_axes)
    v = constrain(v, kv_axes)
    order = positions if segment_ids is not None and positions is not None else \
        jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
    if chunks:
        from jaxtron.ops import chunked
        out = chunked.context_parallel_attention(q, k, v, constrain(positions, Q_AXES[:2]),
                                                 constrain(segment_ids, Q_AXES[:2]), max_segments=max_segments)
    elif implementation == "cudnn" and segment_ids is not None:
        out = _cudnn_packed(q, k, v, segment_ids, max_segments)
    elif implementation == "blockwise":
        from jaxtron.ops.blockwise import context_parallel_attention
        out = context_parallel_attention(q, k, v, constrain(order, Q_AXES[:2]), segment_ids)
    else:
        mask = None
        if segment_ids is not None:
            mask = (segment_ids[:, None, :, None] == segment_ids[:, None, None, :]) & \
                (order[:, None, None, :] <= order[:, None, :, None])
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=segment_ids is None,
                                           implementation=implementation)
    return checkpoint_name(constrain(out, Q_AXES), OUTPUT_NAME)
