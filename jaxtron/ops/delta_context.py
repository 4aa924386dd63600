"""The gated delta rule over a sequence split across devices (context parallelism), each device on its own columns.

A device holds pieces of each row: two under the zigzag layout (pieces i and 2S - 1 - i of 2S), one under the
contiguous one (``parallel/sharding.sequence_order``). The rule is linear in a piece's starting state S_0: its final
state is Phi S_0 + C and each output is o0_t + S_0^T p_t. One chunked run gives all four, on values widened by dk
columns that start as the identity and receive no values (``ops/delta_rule.py``'s ``chunked`` with a starting
state [0 | I]): the first dv columns give C and o0, the identity's give Phi and p_t.

Then the devices all-gather every piece's (Phi, C), a few megabytes, and each composes the states handed on from
piece to piece in token order, S_{p+1} = Phi_p S_p + C_p, and adds its pieces' S_0 terms. A piece whose first token
starts a document starts from zero. The causal convolution before the rule needs the last taps - 1 inputs of the
piece before: those travel in the same way (``halo``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxtron.ops import delta_rule
from jaxtron.parallel.sharding import SEQUENCE_LAYOUT, constrain, logical_to_spec, spec_axes

QK_AXES = ("activation_batch", "activation_length", "activation_kv_heads", "activation_head_dim")
V_AXES = ("activation_batch", "activation_length", "activation_heads", "activation_head_dim")
GATE_AXES = ("activation_batch", "activation_length", "activation_heads")
ROW_AXES = GATE_AXES[:2]
CONV_QK_AXES = (None, "activation_kv_heads", "activation_head_dim")  # [taps, heads, dim] weights, split as heads
CONV_V_AXES = (None, "activation_heads", "activation_head_dim")

# prepare(q, k, v, conv weights, segments or None) -> the rule's q, k, v of a piece preceded by its halo
Prepare = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def pieces(shards: int, layout: str = SEQUENCE_LAYOUT) -> np.ndarray:
    """[shards, pieces a device] the index in token order of each piece a device holds, in column order."""
    if layout == "contiguous":
        return np.arange(shards)[:, None]
    return np.stack([np.arange(shards), 2 * shards - 1 - np.arange(shards)], axis=1)


def _predecessors(table: np.ndarray) -> np.ndarray:
    """[shards, pieces a device]: where the piece before each lies in the gathered [shards x pieces] list (-1: the
    row's first piece has none)."""
    where = {int(p): i for i, p in enumerate(table.reshape(-1))}
    return np.vectorize(lambda p: where.get(int(p) - 1, -1))(table)


def _take(stacked: jax.Array, index: jax.Array) -> jax.Array:
    """``stacked[index]`` for a traced index that may be -1 (then zeros)."""
    return jnp.where(index >= 0, jax.lax.dynamic_index_in_dim(stacked, jnp.maximum(index, 0), keepdims=False), 0)


def _piece_rule(q, k, v, g, beta, segments):
    """One piece from the unknown state: (o0 [b, t, h, dv], p [b, t, h, dk], C [b, h, dk, dv], Phi [b, h, dk, dk])."""
    b, _, h, dk = k.shape
    dv = v.shape[-1]
    widened = jnp.concatenate([v.astype(jnp.float32), jnp.zeros((*v.shape[:-1], dk), jnp.float32)], axis=-1)
    start = jnp.concatenate([jnp.zeros((b, h, dk, dv), jnp.float32),
                             jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (b, h, dk, dk))], axis=-1)
    out, final = delta_rule.chunked(q, k, widened, g, beta, start, segments)
    return out[..., :dv], out[..., dv:], final[..., :dv], final[..., dv:]


def over_sequence(prepare: Prepare, q: jax.Array, k: jax.Array, v: jax.Array, convs: tuple[jax.Array, ...],
                  g: jax.Array, beta: jax.Array, segments: jax.Array | None) -> jax.Array:
    """The rule's outputs [b, t, value heads, dv] (float32) of the projections q, k [b, t, key heads, dk] and v
    [b, t, value heads, dv] before their convolution (weights ``convs``), with g and beta [b, t, value heads], on a
    sequence split as the rules table splits ``activation_length``, each device on its columns."""
    sequence = spec_axes(logical_to_spec(QK_AXES), 1)
    shards = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in sequence)
    table = pieces(shards)
    before, order = _predecessors(table), np.argsort(table.reshape(-1))  # order: gathered index of each piece
    packed = segments is not None

    def body(q, k, v, cq, ck, cv, g, beta, *packing):
        segments = packing[0] if packed else jnp.zeros(q.shape[:2], jnp.int32)  # one document a row
        shard = jax.lax.axis_index(sequence)
        n, halo = table.shape[1], cq.shape[0] - 1
        size, keep = q.shape[1] // n, max(halo, 1)  # keep: at least the last token, whose document a piece may go on

        def gathered(x):  # [b, t, ...] -> every piece's [b, ...] slice, [shards x pieces, b, ...]
            return jax.lax.all_gather(x, sequence, axis=0, tiled=True)

        def piece(x, j):
            return x[:, j * size:(j + 1) * size]

        tails = [gathered(jnp.stack([piece(x, j)[:, size - keep:] for j in range(n)]))
                 for x in (q, k, v, segments)]
        runs, fresh_starts = [], []
        for j in range(n):
            src = jnp.asarray(before)[shard, j]
            ahead = [_take(t, src)[:, keep - halo:] for t in tails[:3]]
            ahead_segments = jnp.where(src >= 0, _take(tails[3], src), -1)  # none before the row's first piece
            own = piece(segments, j)
            joined = [jnp.concatenate([a, piece(x, j)], axis=1) for a, x in zip(ahead, (q, k, v), strict=True)]
            with_halo = jnp.concatenate([ahead_segments[:, keep - halo:], own], axis=1) if packed else None
            rq, rk, rv = (x[:, halo:] for x in prepare(*joined, (cq, ck, cv), with_halo))
            runs.append(_piece_rule(rq, rk, rv, piece(g, j), piece(beta, j), own if packed else None))
            fresh_starts.append(own[:, 0] != ahead_segments[:, -1] if packed else jnp.zeros(own.shape[:1], bool))
        phi = gathered(jnp.stack([r[3] for r in runs]))
        c = gathered(jnp.stack([r[2] for r in runs]))
        fresh = gathered(jnp.stack(fresh_starts))
        states = [jnp.zeros_like(c[0])]  # the state each piece starts from, in token order
        for p in range(1, len(order)):
            nxt = jnp.einsum("bhij,bhjv->bhiv", phi[order[p - 1]], states[-1]) + c[order[p - 1]]
            states.append(jnp.where(fresh[order[p]][:, None, None, None], 0.0, nxt))
        starts = jnp.stack(states)
        outs = [o0 + jnp.einsum("bthk,bhkv->bthv", p, _take(starts, jnp.asarray(table)[shard, j]))
                for j, (o0, p, _, _) in enumerate(runs)]
        return jnp.concatenate(outs, axis=1)

    axes = (QK_AXES, QK_AXES, V_AXES, CONV_QK_AXES, CONV_QK_AXES, CONV_V_AXES, GATE_AXES, GATE_AXES, ROW_AXES)
    axes = axes if packed else axes[:-1]
    args = [constrain(x, a) for x, a in zip((q, k, v, *convs, g, beta, segments), axes, strict=False)]
    return jax.shard_map(body, in_specs=tuple(logical_to_spec(a) for a in axes), out_specs=logical_to_spec(V_AXES),
                         check_vma=False)(*args)
