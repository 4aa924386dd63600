"""Every call into JAX's private cuDNN attention module (``jax._src.cudnn.fused_attention_stablehlo``).

JAX's public ``jax.nn.dot_product_attention`` reaches the same cuDNN flash kernel, but it takes neither ragged
document offsets (packed rows) nor gives a backward that accepts merged softmax statistics; both exist only in the
private module. Keeping every use here means one file to read when jax changes it, and the tests bind each call
made here to the installed signatures (``tests/test_attention.py``, ``tests/test_chunked.py``), so such a change
fails on a CPU rather than on a GPU.

All inputs are [batch, length, heads, head_dim] ("BTNH"), 16-bit; lengths are int32 per row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as _cudnn
from jax.ad_checkpoint import checkpoint_name

LAYOUT = "BTNH"
FORWARD_PRIMITIVE = "dot_product_attention_fwd"  # the name of cuDNN's forward primitive (and its wrappers)
# the checkpoint names of packed attention's forward outputs, which its backward kernel needs
PACKED_OUTPUT_NAME, PACKED_STATS_NAME = "cudnn_packed_out", "cudnn_packed_stats"


@contextlib.contextmanager
def compute_capability(major: int, minor: int) -> Iterator[None]:
    """Within this context jax's cuDNN attention takes the GPU to be of this compute capability. It asks the default
    backend's first device, which is the CPU when compiling for a GPU target (``jaxtron.gpu.target``), and would
    then refuse what only Hopper runs: the packed layout and head sizes above 128."""
    given = (major, minor)
    saved = _cudnn.check_compute_capability, _cudnn.is_cuda_compute_capability_equal

    def parse(capability: str) -> tuple[int, ...]:
        return tuple(int(x) for x in capability.split("."))

    _cudnn.check_compute_capability = lambda capability: given >= parse(capability)
    _cudnn.is_cuda_compute_capability_equal = lambda capability: given == parse(capability)
    try:
        yield
    finally:
        _cudnn.check_compute_capability, _cudnn.is_cuda_compute_capability_equal = saved


def is_forward(primitive) -> bool:
    """Whether a primitive is cuDNN's attention forward, whose outputs (the attention and its softmax statistics)
    its backward needs: a remat policy that keeps them runs the forward kernel once."""
    return primitive.name.startswith(FORWARD_PRIMITIVE)


def segment_layout(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """Packed rows as jax's cuDNN attention takes them: [batch, M] document lengths and [batch, M+1] document
    start offsets, each padded with -1, M = ``max_segments``. The offsets are starts only, each within its row:
    jax (``_fix_seqlen_offsets``) adds each row's place in the batch, packs every row's documents into one list
    and ends the list with the batch's length itself, so a row's end written after its starts would stand in the
    next row's place and shift every later document's window (the cuDNN call then reads the wrong tokens).

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
    offsets = jnp.where(j < count, bounds, -1).astype(jnp.int32)
    lengths = jnp.where(j[:, :-1] < count, bounds[:, 1:] - bounds[:, :-1], -1).astype(jnp.int32)
    return lengths, offsets


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                     max_segments: int, window: int = 0) -> jax.Array:
    """Causal flash attention over packed documents: each document is its own causal sequence inside the kernel
    (ragged offsets), so no [length, length] mask is built and nothing attends across documents. ``window`` > 0:
    each token sees only the ``window`` latest tokens of its document up to itself (cuDNN's sliding window).

    Its forward and backward kernels are each called through ``_row_batched``, so that under ``jax.vmap`` (a
    pipeline's stages) the mapped axis joins the rows: jax's own batching rule for the kernel reshapes the
    packed layout's per-row lengths as if there were one per row, and fails."""
    return _packed_kernels(max_segments, window)[0](q, k, v, segment_ids)[0]


def _packed_fwd(q, k, v, segment_ids, max_segments, window):
    # the output and the softmax statistics [rows * max_segments, heads, length] are named so that a remat policy
    # can keep them (models/stack.py: the attention outputs), as it keeps cuDNN's own forward outputs
    out, stats = _packed_kernels(max_segments, window)[0](q, k, v, segment_ids)
    out, stats = checkpoint_name(out, PACKED_OUTPUT_NAME), checkpoint_name(stats, PACKED_STATS_NAME)
    return out, (q, k, v, segment_ids, out, stats)


def _packed_bwd(max_segments, window, res, d_out):
    q, k, v, segment_ids, out, stats = res
    return (*_packed_kernels(max_segments, window)[1](q, k, v, segment_ids, out, stats, d_out), None)


packed_attention.defvjp(_packed_fwd, _packed_bwd)


def _row_batched(fn: Callable) -> Callable:
    """``fn`` of arrays whose first axis is the rows, made to take a ``jax.vmap`` axis by folding it into the rows
    (and the outputs' first axes back out of them)."""
    batched = jax.custom_batching.custom_vmap(fn)

    @batched.def_vmap
    def rule(axis_size, in_batched, *args):
        args = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, b in zip(args, in_batched, strict=True)]
        outs = batched(*(x.reshape(-1, *x.shape[2:]) for x in args))
        return tuple(y.reshape(axis_size, -1, *y.shape[1:]) for y in outs), tuple(True for _ in outs)

    return batched


@functools.cache
def _packed_kernels(max_segments: int, window: int = 0) -> tuple[Callable, Callable]:
    """(forward, backward) of packed attention with up to ``max_segments`` documents a row (and a sliding
    ``window``, 0 for none), each batched by rows."""

    def forward(q, k, v, segment_ids):
        lengths, offsets = segment_layout(segment_ids, max_segments)
        return _forward(q, k, v, lengths, lengths, _cudnn.MaskType.PADDING_CAUSAL, offsets, window)

    def backward(q, k, v, segment_ids, out, stats, d_out):
        lengths, offsets = segment_layout(segment_ids, max_segments)
        return _backward(q, k, v, lengths, lengths, _cudnn.MaskType.PADDING_CAUSAL, out, stats, d_out, offsets,
                         window)

    return _row_batched(forward), _row_batched(backward)


def token_stats_index(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """Where the packed kernel's softmax statistics [rows * M, heads, length] hold each token's log-sum-exp:
    ([b, t] the token's document in the batch's list of documents, [b, t] the token's place in its document).

    XLA's graph gives the statistics no ragged offset: cuDNN writes each document's as a sequence of its own, at
    its place in the list jax makes of the batch's documents (every row's in order, a row's unused slots left out:
    ``_fix_seqlen_offsets``). XLA's builders and cuDNN frontend's ragged test read so; a GPU has not checked it."""
    lengths, offsets = segment_layout(segment_ids, max_segments)
    count = jnp.sum(lengths >= 0, axis=1)
    before = jnp.cumsum(count) - count  # documents in the rows before
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                             axis=1)
    document = jnp.cumsum(starts, axis=1) - 1  # the token's document within its row
    first = jnp.take_along_axis(offsets, document, axis=1)
    return before[:, None] + document, jnp.arange(segment_ids.shape[1])[None, :] - first


@functools.cache
def _packed_stats_kernels(max_segments: int, window: int) -> tuple[Callable, Callable]:
    """(forward -> (output, log-sum-exp [b, t, heads]), backward given a log-sum-exp laid out so) of packed attention,
    each batched by rows, so that the statistics' list of documents is the batch the kernel sees."""
    forward, backward = _packed_kernels(max_segments, window)

    def forward_lse(q, k, v, segment_ids):
        out, stats = forward(q, k, v, segment_ids)
        document, place = token_stats_index(segment_ids, max_segments)
        return out, stats[document, :, place]  # [b, t, heads]

    def backward_lse(q, k, v, segment_ids, out, lse, d_out):
        document, place = token_stats_index(segment_ids, max_segments)
        shape = (q.shape[0] * max_segments, q.shape[2], q.shape[1])
        stats = jnp.zeros(shape, jnp.float32).at[document, :, place].set(lse.astype(jnp.float32))
        return backward(q, k, v, segment_ids, out, stats, d_out)

    return _row_batched(forward_lse), _row_batched(backward_lse)


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """cuDNN's packed kernel (optionally windowed) as a ``sinks.StatsKernel``: the attention of packed documents
    with sinks folded in after it (``ops/sinks.py``). ``extras``: (segment ids,)."""

    max_segments: int
    window: int = 0

    def forward(self, q, k, v, extras):
        return _packed_stats_kernels(self.max_segments, self.window)[0](q, k, v, extras[0])

    def backward(self, q, k, v, extras, out, lse, d_out):
        return _packed_stats_kernels(self.max_segments, self.window)[1](q, k, v, extras[0], out.astype(q.dtype), lse,
                                                                         d_out.astype(q.dtype))


def _mask(causal: bool):
    return _cudnn.MaskType.PADDING_CAUSAL if causal else _cudnn.MaskType.PADDING


def _lengths(n: jax.Array) -> jax.Array:
    """Lengths for the kernel: 0 is raised to 1 (the kernel needs one row or key; callers discard those rows)."""
    return jnp.maximum(n, 1).astype(jnp.int32)


def _forward(q, k, v, q_seqlen, kv_seqlen, mask, offsets=None, window: int = 0) -> tuple[jax.Array, jax.Array]:
    """cuDNN's forward: (output, softmax statistics as the kernel lays them out). ``window`` > 0: each query sees
    the ``window`` latest keys up to its own position (cuDNN's ``sliding_window_length``)."""
    ragged = {} if offsets is None else dict(q_offsets=offsets, kv_offsets=offsets)
    return _cudnn.dot_product_attention(q, k, v, q_seqlen=q_seqlen, kv_seqlen=kv_seqlen,
                                        scale=1.0 / math.sqrt(q.shape[-1]), mask_type=mask, qkv_layout=LAYOUT,
                                        sliding_window_length=window or None, return_residual=True, **ragged)


def _backward(q, k, v, q_seqlen, kv_seqlen, mask, out, stats, d_out,
              offsets=None, window: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """cuDNN's backward of a ``_forward`` call, given an output and statistics (its own, or a merge's)."""
    unused = jnp.zeros(0, q.dtype)
    offsets = unused if offsets is None else offsets
    res = (q, k, v, unused, q_seqlen, kv_seqlen, offsets, offsets, unused, unused, stats, out)
    # the rule's arguments before ``res`` are the custom_vjp's static ones: scale, seed, dropout rate, (bias,
    # bias gradient), mask, layout, window, is_training, return_residual
    grads = _cudnn._dot_product_attention_bwd_rule(
        1.0 / math.sqrt(q.shape[-1]), 42, 0.0, (False, False), mask, _cudnn._normalize_layout(LAYOUT).value,
        window or None, True, False, res, d_out)
    return tuple(grads[:3])


def forward_with_stats(q: jax.Array, k: jax.Array, v: jax.Array, q_len: jax.Array, kv_len: jax.Array,
                       causal: bool, window: int = 0) -> tuple[jax.Array, jax.Array]:
    """Queries 0..q_len against keys 0..kv_len (per row), causal or not (with ``window`` > 0: within the sliding
    window) -> (output, softmax statistics [b, t, heads]: float32, the natural log-sum-exp of the scaled scores)."""
    out, stats = _forward(q, k, v, _lengths(q_len), _lengths(kv_len), _mask(causal), window=window)
    return out, jnp.swapaxes(stats, 1, 2)


def backward_from_stats(q: jax.Array, k: jax.Array, v: jax.Array, q_len: jax.Array, kv_len: jax.Array,
                        causal: bool, out: jax.Array, lse: jax.Array, d_out: jax.Array,
                        window: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of q, k, v of the ``forward_with_stats`` call, given the output ``out`` and statistics ``lse``
    [b, t, heads] of a merge the call is part of (flash attention's backward over several blocks of keys)."""
    return _backward(q, k, v, _lengths(q_len), _lengths(kv_len), _mask(causal), out.astype(q.dtype),
                     jnp.swapaxes(lse, 1, 2).astype(jnp.float32), d_out.astype(q.dtype), window=window)


@dataclasses.dataclass(frozen=True)
class WholeRows:
    """cuDNN's causal kernel on whole rows, optionally windowed, as a ``sinks.StatsKernel``: the attention of
    unpacked rows with sinks folded in after it (``ops/sinks.py``)."""

    window: int = 0

    def forward(self, q, k, v, extras):
        length = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
        return forward_with_stats(q, k, v, length, length, True, self.window)

    def backward(self, q, k, v, extras, out, lse, d_out):
        length = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
        return backward_from_stats(q, k, v, length, length, True, out, lse, d_out, self.window)
