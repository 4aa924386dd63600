"""Blockwise causal attention in XLA (flash-style): queries and keys are taken a block at a time and the softmax
is accumulated online, so no [length, length] score matrix is ever held, in the forward or the backward pass.

It is the reference path for context parallelism: the causal and document masks come from each token's global
position and document id, not from its index, so a device may hold any slice of queries (e.g. the two chunks of
a load-balanced layout) against keys gathered from the whole sequence. Blocks that the mask hides entirely are
skipped. Besides the output it returns each query's log-sum-exp of scores (its softmax statistics), so partial
results over disjoint key sets can be combined (``combine``).

The backward pass is hand-written (``jax.custom_vjp``): it recomputes each block's probabilities from the saved
log-sum-exp instead of keeping them, as flash attention does. ``forward`` and ``backward`` are public so that a
caller merging several calls (``ops/chunked.py``) can run the backward of each on the merged statistics.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxtron.ops import sinks as sink_ops
from jaxtron.ops.sequence import over_sequence

MASKED = -1e30  # the score of a hidden key: finite, so a row that sees nothing gives no NaN


def block_size(length: int, wanted: int) -> int:
    """The largest divisor of ``length`` that is at most ``wanted``."""
    return max(d for d in range(1, min(length, wanted) + 1) if length % d == 0)


def _visible(q_pos, k_pos, q_seg, k_seg, window=0):
    """[b, 1, 1, tq, tk]: key j is visible to query i (causal by position, inside the same document, and with
    ``window`` > 0 among the ``window`` latest positions up to the query's)."""
    seen = k_pos[:, None, :] <= q_pos[:, :, None]
    if window:
        seen &= q_pos[:, :, None] - k_pos[:, None, :] < window
    if q_seg is not None:
        seen &= k_seg[:, None, :] == q_seg[:, :, None]
    return seen[:, None, None]


def _blocks(x, size):
    """[b, L, ...] -> [L / size, b, size, ...]."""
    return jnp.moveaxis(x.reshape(x.shape[0], x.shape[1] // size, size, *x.shape[2:]), 1, 0)


def _unblocks(x):
    """The inverse of ``_blocks``."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _blocked(q, k, v, q_pos, k_pos, q_seg, k_seg, block_q, block_k):
    """The sizes (block of queries, group of query heads per kv head, score scale) and the blocked inputs: queries
    [nq, b, bq, kv_heads, group, d] with their positions and document ids, and (keys, values, positions, document
    ids) in blocks of keys."""
    b, lq, h, d = q.shape
    kvh = k.shape[2]
    g, bq, bk = h // kvh, block_size(lq, block_q), block_size(k.shape[1], block_k)
    maybe = lambda x, size: None if x is None else _blocks(x, size)
    queries = (_blocks(q.reshape(b, lq, kvh, g, d), bq), _blocks(q_pos, bq), maybe(q_seg, bq))
    keys = (_blocks(k, bk), _blocks(v, bk), _blocks(k_pos, bk), maybe(k_seg, bk))
    return (bq, g, 1.0 / math.sqrt(d)), queries, keys


def forward(q, k, v, q_pos, k_pos, q_seg, k_seg, block_q: int, block_k: int,
            window: int = 0) -> tuple[jax.Array, jax.Array]:
    """(output [b, Lq, heads, d], log-sum-exp [b, Lq, heads]) of ``blockwise_attention``, without its custom
    gradient; document ids may be None for both."""
    # the masks depend on positions only; inside a differentiated scan (the layer stack) that would make them
    # loop-invariant, and autodiff would compute them ahead of the loop for every pair of blocks at once
    q, q_pos, k_pos, q_seg, k_seg = jax.lax.optimization_barrier((q, q_pos, k_pos, q_seg, k_seg))
    b, _, h, d = q.shape
    kvh = k.shape[2]
    (bq, g, scale), (qs, qps, qss), keys = _blocked(q, k, v, q_pos, k_pos, q_seg, k_seg, block_q, block_k)

    def one_query_block(args):
        qb, qp, qsg = args

        def step(carry, kv):
            kb, vb, kp, ksg = kv
            seen = _visible(qp, kp, qsg, ksg, window)

            def update(carry):
                m, l, acc = carry
                s = jnp.einsum("bqhgd,bkhd->bhgqk", qb, kb, preferred_element_type=jnp.float32) * scale
                s = jnp.where(seen, s, MASKED)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.exp(s - m_new[..., None]) * seen
                alpha = jnp.exp(m - m_new)
                acc = acc * alpha[..., None] + jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(vb.dtype), vb,
                                                          preferred_element_type=jnp.float32)
                return m_new, l * alpha + p.sum(-1), acc

            return jax.lax.cond(seen.any(), update, lambda c: c, carry), None

        start = (jnp.full((b, kvh, g, bq), MASKED, jnp.float32), jnp.zeros((b, kvh, g, bq), jnp.float32),
                 jnp.zeros((b, kvh, g, bq, d), jnp.float32))
        (m, l, acc), _ = jax.lax.scan(step, start, keys)
        out = acc / jnp.where(l > 0, l, 1.0)[..., None]
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), MASKED)
        # [b, kvh, g, bq, d] -> [b, bq, h, d]; [b, kvh, g, bq] -> [b, bq, h]
        return (jnp.moveaxis(out, 3, 1).reshape(b, bq, h, d),
                jnp.moveaxis(lse, 3, 1).reshape(b, bq, h))

    out, lse = jax.lax.map(one_query_block, (qs, qps, qss))
    return _unblocks(out).astype(q.dtype), _unblocks(lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _attention(q, k, v, q_pos, k_pos, q_seg, k_seg, block_q, block_k, window):
    return forward(q, k, v, q_pos, k_pos, q_seg, k_seg, block_q, block_k, window)


def _attention_fwd(q, k, v, q_pos, k_pos, q_seg, k_seg, block_q, block_k, window):
    out, lse = forward(q, k, v, q_pos, k_pos, q_seg, k_seg, block_q, block_k, window)
    return (out, lse), (q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse)


def _attention_bwd(block_q, block_k, window, res, cotangents):
    q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse = res
    return (*backward(q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse, *cotangents, block_q, block_k, window),
            None, None, None, None)


def backward(q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse, d_out, d_lse, block_q: int,
             block_k: int, window: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of q, k, v for the output ``out`` and log-sum-exp ``lse`` of a ``forward`` call, or of a merge
    of several calls this one is part of (then ``out`` and ``lse`` are the merged ones), with cotangents ``d_out``
    and ``d_lse`` (None: zero)."""
    if d_lse is None:
        d_lse = jnp.zeros(lse.shape, jnp.float32)
    b, lq, _, d = q.shape
    kvh = k.shape[2]
    (bq, g, scale), (qs, qps, qss), keys = _blocked(q, k, v, q_pos, k_pos, q_seg, k_seg, block_q, block_k)
    # per query: D = sum(dO * O), the softmax's own term; both it and d_lse enter every score's gradient
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1) - d_lse.astype(jnp.float32)

    def per_kv_head(x):  # [b, L, h] -> [b, L, kvh, g]
        return x.reshape(*x.shape[:2], kvh, g)

    dos = _blocks(d_out.reshape(b, lq, kvh, g, d), bq)
    lses, deltas = _blocks(per_kv_head(lse), bq), _blocks(per_kv_head(delta), bq)

    def one_query_block(dkv, args):
        qb, dob, lseb, deltab, qp, qsg = args
        lseb, deltab = jnp.moveaxis(lseb, 1, 3), jnp.moveaxis(deltab, 1, 3)  # [b, kvh, g, bq]

        def step(dq, kv):
            kb, vb, kp, ksg = kv
            seen = _visible(qp, kp, qsg, ksg, window)

            def grads(dq):
                s = jnp.einsum("bqhgd,bkhd->bhgqk", qb, kb, preferred_element_type=jnp.float32) * scale
                p = jnp.exp(jnp.where(seen, s, MASKED) - lseb[..., None]) * seen
                dp = jnp.einsum("bqhgd,bkhd->bhgqk", dob, vb, preferred_element_type=jnp.float32)
                ds = p * (dp - deltab[..., None]) * scale
                dq = dq + jnp.einsum("bhgqk,bkhd->bqhgd", ds, kb.astype(jnp.float32))
                dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qb.astype(jnp.float32))
                dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, dob.astype(jnp.float32))
                return dq, dk, dv

            def skip(dq):
                zero = jnp.zeros(kb.shape, jnp.float32)
                return dq, zero, zero

            dq, dk, dv = jax.lax.cond(seen.any(), grads, skip, dq)
            return dq, (dk, dv)

        dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(qb.shape, jnp.float32), keys)
        return (dkv[0] + _unblocks(dk), dkv[1] + _unblocks(dv)), dq

    zero = jnp.zeros(k.shape, jnp.float32)
    (dk, dv), dq = jax.lax.scan(one_query_block, (zero, zero), (qs, dos, lses, deltas, qps, qss))
    dq = _unblocks(dq).reshape(q.shape)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                        k_positions: jax.Array, q_segments: jax.Array | None = None,
                        k_segments: jax.Array | None = None, *, block_q: int = 512,
                        block_k: int = 512, window: int = 0) -> tuple[jax.Array, jax.Array]:
    """Causal grouped-query attention of queries q [b, Lq, heads, d] over keys and values k, v [b, Lk, kv_heads,
    d]: key j is visible to query i when ``k_positions[j] <= q_positions[i]`` and (with segments) both belong to
    the same document. Returns the output [b, Lq, heads, d] and each query's log-sum-exp of scaled scores
    [b, Lq, heads] (float32; ``MASKED`` where no key is visible, with a zero output). Blocks of ``block_q``
    queries and ``block_k`` keys (the largest divisors of the lengths up to those sizes). ``window`` > 0: only the
    ``window`` latest positions up to a query's are visible to it; blocks wholly outside are skipped."""
    if (q_segments is None) != (k_segments is None):
        raise ValueError("give document ids for both queries and keys, or for neither")
    return _attention(q, k, v, q_positions, k_positions, q_segments, k_segments, block_q, block_k, window)


def combine(parts: list[tuple[jax.Array, jax.Array]]) -> tuple[jax.Array, jax.Array]:
    """The attention over the union of disjoint key sets, from each set's (output, log-sum-exp)."""
    lse = jnp.stack([p[1] for p in parts])
    total = jax.nn.logsumexp(lse, axis=0)
    weights = jnp.exp(lse - total)[..., None]
    out = sum(w * p[0].astype(jnp.float32) for w, p in zip(weights, parts, strict=True))
    return out.astype(parts[0][0].dtype), total


def context_parallel_attention(q: jax.Array, k: jax.Array, v: jax.Array, index: jax.Array,
                               segment_ids: jax.Array | None = None, *, block_q: int = 512, block_k: int = 512,
                               window: int = 0, sinks: jax.Array | None = None) -> jax.Array:
    """Causal attention with the sequence sharded as the rules table says (``activation_length``): each device
    keeps its queries, gathers the keys and values of the whole sequence (with their token indices and document
    ids) over the sequence axes, and runs ``blockwise_attention`` on them. ``index`` [b, L] is each token's index
    in its row (causality follows it, so any layout of the tokens over the devices is exact). The keys of
    grouped-query attention are a fraction of the queries' size, which makes gathering them cheaper than passing
    them around a ring; no device ever holds a [length, length] score matrix. Outside a mesh: the plain call.

    With a ``window`` no longer than half a device's columns, a device gathers only the window's keys: the last
    ``window`` - 1 of each half of every device's columns (``window_keys``). ``sinks`` [heads]: each head's sink
    logit, folded in from the log-sum-exp (``ops/sinks.py``)."""
    def attend(q, k, v, q_index, k_index, q_segments, k_segments):
        return blockwise_attention(q, k, v, q_index, k_index, q_segments, k_segments, block_q=block_q,
                                   block_k=block_k, window=window)

    if jax.sharding.get_abstract_mesh().empty:
        out, lse = attend(q, k, v, index, index, segment_ids, segment_ids)
        return out if sinks is None else sink_ops.fold(out, lse, sinks)

    def local(q, k, v, index, segments, gathered, shard, shards):
        if window and 1 < window <= q.shape[1] // 2 + 1 and q.shape[1] % 2 == 0:
            keys = window_keys(k, v, index, segments, window, gathered, shard, shards)
        else:
            keys = tuple(None if x is None else gathered(x) for x in (k, v, index, segments))
        out, lse = attend(q, keys[0], keys[1], index, keys[2], segments, keys[3])
        return out if sinks is None else (out, lse)  # the statistics leave the shard_map only when used

    if sinks is None:
        return over_sequence(local, q, k, v, index, segment_ids)
    out, lse = over_sequence(local, q, k, v, index, segment_ids, with_stats=True)
    return sink_ops.fold(out, lse, sinks)


FAR = 1 << 30  # the index of a key no query sees (it is later than every one)


def window_keys(k, v, index, segments, window: int, gathered, shard, shards: int):
    """A device's keys and values for windowed attention, with their indices and document ids: its own columns,
    then the last ``window`` - 1 columns of each half of every device's columns (the two halves are runs of
    consecutive tokens in the loader's layout, and in the plain split). The tails of this device's own halves
    come back too; their indices are set to ``FAR``, so that no key is counted twice."""
    half, tail = k.shape[1] // 2, window - 1

    def tails(x):  # [b, 2 * (window - 1), ...]: the end of each half
        return jnp.concatenate([x[:, half - tail:half], x[:, 2 * half - tail:]], axis=1)

    own = jnp.arange(shards * 2 * tail) // (2 * tail) == shard
    far_index = jnp.where(own[None, :], FAR, gathered(tails(index)))
    keys = [jnp.concatenate([x, gathered(tails(x))], axis=1) for x in (k, v)]
    seg = None if segments is None else jnp.concatenate([segments, gathered(tails(segments))], axis=1)
    return keys[0], keys[1], jnp.concatenate([index, far_index], axis=1), seg
