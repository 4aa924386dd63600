"""Attention: one entry point, implementation chosen from config plus platform (this file only dispatches).

'xla' is the reference path everywhere (whole score matrices); 'cudnn' is the fused flash-attention kernel on
NVIDIA GPUs; 'blockwise' is flash-style attention written in XLA (``ops/blockwise.py``), which 'auto' takes when
the sequence axis is sharded (context parallelism): each device keeps its queries and gathers the keys and
values of the whole sequence, and no [length, length] matrix is held. An explicit 'cudnn' on a sharded sequence
runs cuDNN on those gathered keys by chunks (``ops/chunked.py``): a few calls per chunk of queries, shaped by
lengths, merged by their softmax statistics.

The files below depend only downward: ``sequence.py`` (the operands' logical layout and the ``shard_map`` over a
sharded sequence), ``blockwise.py`` (the XLA kernel), ``cudnn.py`` (every call into jax's private cuDNN module),
``chunked.py`` (the chunk path, on either kernel), then this dispatcher.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxtron.config.schema import ConfigError
from jaxtron.ops import blockwise, chunked, cudnn, dense
from jaxtron.ops import sinks as sink_ops
from jaxtron.ops.sequence import KV_AXES, KV_SHARDED_AXES, Q_AXES, ROW_AXES, sequence_axes
from jaxtron.parallel.sharding import constrain

OUTPUT_NAME = "attention_out"  # checkpoint name of the attention output (remat policies can keep it)


HOPPER = (9, 0)


def cudnn_unsupported(dtype: jnp.dtype, head_dim: int, sequence_shards: int, backend: str,
                      capability: tuple[int, int] | None = None) -> str | None:
    """Why JAX's cuDNN flash attention cannot run this configuration on a GPU of compute ``capability`` (None:
    taken to be older than Hopper), or None when it can. Hopper takes heads up to 256 wide, older GPUs up to 128."""
    if backend != "gpu":
        return f"the backend is {backend}, not a GPU"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"compute dtype {jnp.dtype(dtype).name} is not 16-bit"
    widest = 256 if capability is not None and tuple(capability) >= HOPPER else 128
    if head_dim % 8 or head_dim > widest:
        on = "this GPU" if capability is not None else "a GPU older than Hopper"
        return f"head_dim {head_dim} is not a multiple of 8 up to {widest}, as cuDNN needs on {on}"
    return None


def device_capability() -> tuple[int, int] | None:
    """The compute capability of the first local GPU, or None without one."""
    if jax.default_backend() != "gpu":
        return None
    major, minor = jax.local_devices()[0].compute_capability.split(".")[:2]
    return int(major), int(minor)


def resolve_implementation(choice: str, dtype: jnp.dtype, head_dim: int = 128, sequence_shards: int = 1,
                           backend: str | None = None, capability: tuple[int, int] | None = None) -> str:
    """'auto' -> 'blockwise' when the sequence is sharded, else 'cudnn' where JAX's cuDNN kernel supports the
    configuration and 'xla' where it does not. (On a sharded sequence cuDNN runs by chunks only when asked for,
    until a GPU has measured it against the blockwise kernel.)

    An explicit 'cudnn' that cannot run is a ConfigError naming the reason. ``capability``: the GPU's compute
    capability (default: the local GPU's, when there is one).
    """
    reason = cudnn_unsupported(dtype, head_dim, sequence_shards, backend or jax.default_backend(),
                               capability or device_capability())
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


@jax.named_scope("attention")
def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: str = "xla",
                          segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                          max_segments: int = 64, window: int = 0, sinks: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention.

    q: [batch, length, heads, head_dim]; k, v: [batch, length, kv_heads, head_dim] with kv_heads
    dividing heads (keys/values are never repeated in memory). segment_ids: optional [batch, length]
    document ids; tokens attend only within their own document. With them, ``positions`` [batch, length] (each
    token's position in its document) decide causality, so the columns may hold the tokens in any order (the
    loader's load-balanced layout of a sharded sequence); without them, the column order is the token order.
    With cuDNN, packed documents go to the kernel as per-document lengths and offsets (at most ``max_segments``
    per row); on a sharded sequence it runs by chunks of the loader's layout, which needs the segment ids and
    positions.

    ``window`` > 0: a query sees only the ``window`` latest positions up to its own (a local layer). ``sinks``
    [heads]: each head's sink logit beside the keys (``ops/sinks.py``).
    """
    q = constrain(q, Q_AXES)
    chunks = implementation == "cudnn" and bool(sequence_axes())
    if chunks and (segment_ids is None or positions is None):
        raise ValueError("cuDNN attention on a sharded sequence needs the loader's segment ids and positions")
    if chunks and (window or sinks is not None):  # refused with the config (parallel/checks.py)
        raise ValueError("cuDNN attention by chunks takes no window or sinks")
    # blockwise attention gathers the keys and values itself, inside its shard_map: they enter it sharded like
    # the queries (gathering them here as well would gather twice)
    kv_axes = KV_SHARDED_AXES if implementation == "blockwise" or chunks else KV_AXES
    k = constrain(k, kv_axes)
    v = constrain(v, kv_axes)
    order = positions if segment_ids is not None and positions is not None else \
        jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
    if chunks:
        out = chunked.context_parallel_attention(q, k, v, constrain(positions, ROW_AXES),
                                                 constrain(segment_ids, ROW_AXES), max_segments=max_segments)
    elif implementation == "cudnn":
        out = _cudnn_attention(q, k, v, segment_ids, max_segments, window, sinks)
    elif implementation == "blockwise":
        out = blockwise.context_parallel_attention(q, k, v, constrain(order, ROW_AXES), segment_ids, window=window,
                                                   sinks=sinks)
    elif window or sinks is not None:
        out = dense.attention(q, k, v, dense.visible(order, order, segment_ids, segment_ids, window), sinks)
    else:
        mask = None
        if segment_ids is not None:
            mask = (segment_ids[:, None, :, None] == segment_ids[:, None, None, :]) & \
                (order[:, None, None, :] <= order[:, None, :, None])
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=segment_ids is None,
                                           implementation=implementation)
    if implementation == "cudnn" and sinks is None and not chunks:
        # the kernel's own output is already kept for its backward; a second name made remat keep it twice. Llama-3
        # 8B, 8 layers, one H200 target: budget 429.3 -> 427.8 ms, peak -0.9 GiB (a stack copy and a slice gone)
        return constrain(out, Q_AXES)
    return checkpoint_name(constrain(out, Q_AXES), OUTPUT_NAME)


def _cudnn_attention(q, k, v, segment_ids, max_segments: int, window: int, sinks) -> jax.Array:
    """cuDNN's flash kernel on rows that are not split: packed documents through the ragged layout, each local layer
    with cuDNN's sliding window, sinks folded in from the kernel's log-sum-exp."""
    if segment_ids is not None and sinks is not None:
        return sink_ops.with_sinks(cudnn.PackedRows(max_segments, window), q, k, v, sinks, (segment_ids,))
    if segment_ids is not None:
        return cudnn.packed_attention(q, k, v, segment_ids, max_segments, window)
    if sinks is not None:
        return sink_ops.with_sinks(cudnn.WholeRows(window), q, k, v, sinks, ())
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn",
                                        local_window_size=(window - 1, 0) if window else None)
