"""Context-parallel attention by chunks, for fused kernels that take lengths rather than masks (cuDNN on GPUs).

The loader lays a row of L tokens over S sequence shards in chunks of C tokens (``sharding.sequence_order``:
2S chunks, shard i holding chunks i and 2S-1-i). Each device keeps its two chunks of queries and gathers the
row's keys and values. A chunk of queries then needs at most three kernel calls, of the same shapes on every
device (which chunk it is only changes lengths and which keys are picked):

- ``rest``: the chunk against its own keys, causal inside each packed document (the kernel's ragged layout).
  Its rows are right for every document that begins inside the chunk.
- ``head``: the chunk's first x tokens, when they continue a document that began p > 0 tokens earlier (p is
  the first token's position): causal against themselves (queries and keys 0..x of the chunk), merged with
  those x queries against the document's p earlier keys (the gathered row's columns picked so the document
  starts at key 0, all p visible). The two calls are merged by their softmax statistics, and the backward of
  each runs on the merged output and statistics, as flash attention's backward does for several blocks of keys.

Every call is a causal or a full block bounded by query and key lengths, which is what a fused kernel with
padding masks computes without a [length, length] mask. ``XLA`` implements the calls with the blockwise kernel
(``ops/blockwise.py``) and is the reference on every backend; ``CUDNN`` runs them in JAX's cuDNN flash
attention. The chunk layout must be the loader's (positions restarting at each document, documents contiguous).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtron.ops import blockwise, cudnn
from jaxtron.ops.sequence import over_sequence
from jaxtron.parallel.sharding import sequence_order

FAR = 1 << 30  # a key index past every query: hidden by the causal test


@dataclasses.dataclass(frozen=True)
class XlaKernel:
    """The chunk calls in the blockwise XLA kernel (any backend)."""
    block_q: int = 512
    block_k: int = 512

    @staticmethod
    def _indices(q, k, q_len, kv_len, causal):
        """Query and key indices that make the blockwise kernel's test (key <= query) the call's mask."""
        i, j = jnp.arange(q.shape[1])[None, :], jnp.arange(k.shape[1])[None, :]
        q_in, k_in = i < q_len[:, None], j < kv_len[:, None]
        return (jnp.where(q_in, i if causal else 0, -1).astype(jnp.int32),
                jnp.where(k_in, j if causal else 0, FAR).astype(jnp.int32))

    def forward(self, q, k, v, q_len, kv_len, causal):
        """(output, log-sum-exp [b, t, heads]) of queries 0..q_len against keys 0..kv_len, causal or not."""
        q_idx, k_idx = self._indices(q, k, q_len, kv_len, causal)
        return blockwise.forward(q, k, v, q_idx, k_idx, None, None, self.block_q, self.block_k)

    def backward(self, q, k, v, q_len, kv_len, causal, out, lse, d_out):
        """Gradients of q, k, v for the output and statistics ``out``, ``lse`` of a merge this call is part of."""
        q_idx, k_idx = self._indices(q, k, q_len, kv_len, causal)
        return blockwise.backward(q, k, v, q_idx, k_idx, None, None, out, lse, d_out, None, self.block_q,
                                  self.block_k)

    def packed(self, q, k, v, segment_ids, max_segments):
        """Causal attention inside each document of a chunk whose columns are in token order."""
        index = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), segment_ids.shape)
        return blockwise.blockwise_attention(q, k, v, index, index, segment_ids, segment_ids,
                                             block_q=self.block_q, block_k=self.block_k)[0]


@dataclasses.dataclass(frozen=True)
class CudnnKernel:
    """The chunk calls in JAX's cuDNN flash attention (NVIDIA GPUs, 16-bit inputs; ``ops/cudnn.py``): the
    forward returns cuDNN's softmax statistics, the backward is cuDNN's own given the merged output and statistics
    instead of the call's. Lengths of 0 are raised to 1 for the kernel: the merge discards those rows and gives
    them no gradient."""

    def forward(self, q, k, v, q_len, kv_len, causal):
        return cudnn.forward_with_stats(q, k, v, q_len, kv_len, causal)

    def backward(self, q, k, v, q_len, kv_len, causal, out, lse, d_out):
        return cudnn.backward_from_stats(q, k, v, q_len, kv_len, causal, out, lse, d_out)

    def packed(self, q, k, v, segment_ids, max_segments):
        return cudnn.packed_attention(q, k, v, segment_ids, max_segments)


XLA, CUDNN = XlaKernel(), CudnnKernel()


def _valid(q, q_len, kv_len):
    """[b, t, 1]: the rows a call computes (below its query length, with at least one key)."""
    rows = jnp.arange(q.shape[1])[None, :] < q_len[:, None]
    return (rows & (kv_len[:, None] > 0))[..., None]


def _picked(x, take):
    """``x`` [b, L, ...] with its columns picked per row by ``take`` [b, L] (None: as it is)."""
    return x if take is None else jnp.take_along_axis(x, take.reshape(*take.shape, *(1,) * (x.ndim - 2)), axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def merged(kernel, causal: tuple[bool, ...], q, calls):
    """Attention of ``q`` over the union of the key sets of ``calls``, each (k, v, q_len, kv_len, take, give)
    and causal per ``causal``: the kernel runs on k, v with their columns picked by ``take`` [b, L] (a permutation
    of each row, None for none; ``give`` is its inverse), and every call's output is weighted by its share of the
    softmax. Picking inside keeps only k and v for the backward, not a permuted copy per call. Rows no call
    computes are zero."""
    return _merged_fwd(kernel, causal, q, calls)[0]


def _merged_fwd(kernel, causal, q, calls):
    parts = []
    for (k, v, q_len, kv_len, take, _), c in zip(calls, causal, strict=True):
        out, lse = kernel.forward(q, _picked(k, take), _picked(v, take), q_len, kv_len, c)
        ok = _valid(q, q_len, kv_len)
        parts.append((jnp.where(ok[..., None], out, 0).astype(q.dtype), jnp.where(ok, lse, blockwise.MASKED)))
    out, lse = blockwise.combine(parts)
    return out, (q, calls, out, lse)


def _merged_bwd(kernel, causal, res, d_out):
    q, calls, out, lse = res
    dq, d_calls = jnp.zeros(q.shape, jnp.float32), []
    for (k, v, q_len, kv_len, take, give), c in zip(calls, causal, strict=True):
        ok = _valid(q, q_len, kv_len)
        # rows outside the call get no cotangent and a statistic that makes their probabilities 0
        g = jnp.where(ok[..., None], d_out, 0).astype(d_out.dtype)
        dq_c, dk, dv = kernel.backward(q, _picked(k, take), _picked(v, take), q_len, kv_len, c, out,
                                       jnp.where(ok, lse, -blockwise.MASKED), g)
        dq = dq + dq_c.astype(jnp.float32)
        d_calls.append((_picked(dk, give), _picked(dv, give), None, None, None, None))
    return dq.astype(q.dtype), tuple(d_calls)


merged.defvjp(_merged_fwd, _merged_bwd)


def chunk_attention(kernel, q, k, v, positions, segment_ids, k_all, v_all, in_order, start, max_segments: int):
    """Causal attention of one chunk of queries q [b, C, heads, d] (keys k, v of the same chunk; ``positions``
    and ``segment_ids`` [b, C] the loader's) given the whole row's keys and values ``k_all``, ``v_all``
    [b, L, ...] in any column order, ``in_order`` [L] (numpy) the column holding each token, and the chunk's
    first token ``start`` (may be traced)."""
    size, length = q.shape[1], k_all.shape[1]
    first = positions[:, 0]  # > 0: the chunk begins inside a document that began this many tokens earlier
    # the head: the chunk's tokens in its first document (with first == 0 its earlier part is empty and the head
    # is that document's causal attention alone)
    x = jnp.sum(jnp.cumprod(segment_ids == segment_ids[:, :1], axis=1), axis=1).astype(jnp.int32)
    # the document's earlier keys first: key j of the call is token (doc start + j) mod L, in column in_order[.]
    begin = (start - first)[:, None]
    tokens = jnp.arange(length)[None, :]
    take = jnp.asarray(in_order, jnp.int32)[(tokens + begin) % length]
    # the inverse: column i holds token order[i], which is key (order[i] - doc start) mod L of the call
    give = (jnp.asarray(np.argsort(in_order), jnp.int32)[None, :] - begin) % length
    head = merged(kernel, (True, False), q,
                  ((k, v, x, x, None, None), (k_all, v_all, x, first.astype(jnp.int32), take, give)))
    # with no document beginning inside any row's chunk, the whole chunk is the head
    rest = jax.lax.cond(jnp.any(x < size), lambda: kernel.packed(q, k, v, segment_ids, max_segments),
                        lambda: jnp.zeros_like(q))
    return jnp.where((jnp.arange(size)[None, :] < x[:, None])[..., None, None], head, rest)


def shard_chunks(length: int, shards: int) -> np.ndarray:
    """[shards, n]: the first token of each run of ``length // (2 * shards)`` consecutive tokens shard i holds
    in the loader's layout (two per shard), checked to be runs."""
    size = length // (2 * shards)
    runs = sequence_order(length, shards).reshape(shards, 2, size)
    if not np.all(np.diff(runs, axis=-1) == 1):
        raise ValueError(f"the layout of {length} tokens over {shards} shards is not runs of {size}")
    return runs[:, :, 0]


def shard_attention(kernel, q, k, v, positions, segment_ids, k_all, v_all, shard, shards: int,
                    max_segments: int):
    """One shard's causal attention: its queries q [b, 2C, heads, d] (keys k, v, positions, segment ids of the
    same columns) against ``k_all``, ``v_all`` [b, L, kv_heads, d], the row's keys gathered in shard order."""
    length = k_all.shape[1]
    size = length // (2 * shards)
    in_order = np.argsort(sequence_order(length, shards))  # the gathered column holding each token
    starts = jnp.asarray(shard_chunks(length, shards), jnp.int32)[shard]
    outs = []
    for j in range(2):
        cols = slice(j * size, (j + 1) * size)
        outs.append(chunk_attention(kernel, q[:, cols], k[:, cols], v[:, cols], positions[:, cols],
                                    segment_ids[:, cols], k_all, v_all, in_order, starts[j], max_segments))
    return jnp.concatenate(outs, axis=1)


def context_parallel_attention(q, k, v, positions, segment_ids, *, kernel=None, max_segments: int = 64):
    """Causal attention with the sequence sharded as the rules table says, by chunks (see the module): q [b, L,
    heads, d], k, v [b, L, kv_heads, d], ``positions`` and ``segment_ids`` [b, L] as the loader lays them out.
    ``kernel``: the cuDNN one unless given."""
    kernel = kernel or CUDNN

    def local(q, k, v, positions, segment_ids, gathered, shard, shards):
        return shard_attention(kernel, q, k, v, positions, segment_ids, gathered(k), gathered(v), shard, shards,
                               max_segments)

    return over_sequence(local, q, k, v, positions, segment_ids)
