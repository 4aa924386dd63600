"""The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5), token by token and by chunks.

Each head keeps a state S [dk, dv]. At step t, with a log-decay g_t <= 0 and a write strength beta_t in (0, 1):

    S_t = exp(g_t) S_{t-1} + k_t w_t^T,   w_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = S_t^T q_t

So the state first decays, then the value it already predicts for k_t is corrected toward v_t (the delta rule).
``recurrent`` runs this literally; generation uses it, one token per call. ``chunked`` gives the same outputs with
matrix products: training runs it.

The chunked form, for one chunk of C steps starting from a state S_0. Let G_i be the cumulative log-decay within
the chunk and D_ij = exp(G_i - G_j) for j <= i. Unrolling the recurrence gives the deltas W [C, dv] from one
lower-triangular system, (I + A) W = beta V - (beta exp(G) K) S_0, with A_ij = beta_i D_ij k_i . k_j for j < i.
With T = (I + A)^-1, U = T (beta V) and E = T (beta exp(G) K), the deltas are W = U - E S_0. Then

    O = (exp(G) Q) S_0 + (Q K^T * D, lower with the diagonal) W,   S_C = exp(G_C) S_0 + (exp(G_C - G) K)^T W.

Everything but S_0 is computed for all chunks at once. A scan over the chunks carries S. Every exponent is at
most 0, so nothing overflows. Arithmetic is float32, as the published kernels keep the state.

Packed rows hold several documents (``segments``): the state starts from zero at each document's first token. In
the chunked form, a term that would carry the state across a document's start is masked: D_ij between documents,
S_0's reads by tokens after a start within the chunk, and the hand-on to the next chunk of what precedes one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtron.config.subsections import DELTA_CHUNK as CHUNK


def _float32(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(a.astype(jnp.float32) for a in arrays)


def runs(segments: jax.Array | None, shape: tuple[int, int]) -> jax.Array:
    """[b, t] int: which run of equal segment ids each token is in, counting from 0 at the row's first token (no
    segments: 0 everywhere). A new run is a document's start, where the state resets."""
    if segments is None:
        return jnp.zeros(shape, jnp.int32)
    starts = jnp.concatenate([jnp.zeros_like(segments[:, :1]), segments[:, 1:] != segments[:, :-1]], axis=1)
    return jnp.cumsum(starts.astype(jnp.int32), axis=1)


def recurrent(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
              state: jax.Array | None = None, segments: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The rule token by token. q, k [b, t, h, dk], v [b, t, h, dv], g and beta [b, t, h]; ``state`` [b, h, dk,
    dv] (default zeros); ``segments`` [b, t] (packed documents: the state resets where the id changes). -> (outputs
    [b, t, h, dv] in v's dtype, the final state, float32)."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    state = jnp.zeros((b, h, dk, dv), jnp.float32) if state is None else state.astype(jnp.float32)
    run = runs(segments, (b, t))
    keep = (run == jnp.concatenate([run[:, :1], run[:, :-1]], axis=1)).astype(jnp.float32)  # [b, t]

    def step(s, x):
        q_t, k_t, v_t, g_t, beta_t, keep_t = x
        s = s * (jnp.exp(g_t) * keep_t[:, None])[..., None, None]
        predicted = jnp.einsum("bhkv,bhk->bhv", s, k_t)
        s = s + jnp.einsum("bhk,bhv->bhkv", k_t, beta_t[..., None] * (v_t - predicted))
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

    steps = tuple(jnp.moveaxis(a, 1, 0) for a in (*_float32(q, k, v, g, beta), keep))
    state, out = jax.lax.scan(step, state, steps)
    return jnp.moveaxis(out, 0, 1).astype(v.dtype), state


def _in_chunks(x: jax.Array, chunk: int, heads: bool = True) -> jax.Array:
    """[b, t, h, ...] padded to whole chunks -> [b, h, chunks, chunk, ...] (zeros), or without ``heads`` [b, t]
    -> [b, chunks, chunk] (the last value repeated)."""
    pad = -x.shape[1] % chunk
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), mode="constant" if heads else "edge")
    x = x.reshape(x.shape[0], -1, chunk, *x.shape[2:])
    return jnp.moveaxis(x, 3, 1) if heads else x


def unit_lower_inverse(strict: jax.Array) -> jax.Array:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C] (C a power of two), by doubling: the inverse of
    [[L11, 0], [L21, L22]] is [[T11, 0], [-T22 L21 T11, T22]], from blocks of 1 up to one of C. Only matrix
    products, log2(C) rounds of them. A loop of row substitutions kept every row's state for its gradient (17 GB a
    block for Qwen3.5 9B at 8192 tokens); LAPACK's solve inside a scan over chunks hung XLA's CPU runtime on
    several devices."""
    c = strict.shape[-1]
    lead = strict.shape[:-2]
    blocks = jnp.ones((*lead, c, 1, 1), strict.dtype)  # the inverses of the diagonal blocks, [..., m, s, s]
    size = 1
    while size < c:
        m = c // size
        grid = strict.reshape(*lead, m // 2, 2, size, m // 2, 2, size)
        # the block below each pair's first diagonal block: rows of block 2j + 1, columns of block 2j
        lower = jnp.moveaxis(jnp.diagonal(grid[..., :, 1, :, :, 0, :], axis1=-4, axis2=-2), -1, -3)
        first, second = blocks[..., 0::2, :, :], blocks[..., 1::2, :, :]
        corner = -second @ lower @ first
        top = jnp.concatenate([first, jnp.zeros_like(first)], axis=-1)
        bottom = jnp.concatenate([corner, second], axis=-1)
        blocks = jnp.concatenate([top, bottom], axis=-2)
        size *= 2
    return blocks[..., 0, :, :]


def _previous_run(run: jax.Array) -> jax.Array:
    """[b, 1, chunks, 1]: the run of the token before each chunk (the row's first token's, for the first chunk:
    it continues the given state)."""
    return jnp.concatenate([run[:, :, :1, :1], run[:, :, :-1, -1:]], axis=2)


def chunk_terms(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                segments: jax.Array | None = None, chunk: int = CHUNK) -> dict[str, jax.Array]:
    """What each chunk needs besides its starting state, for all chunks at once ([b, h, chunks, ...], float32).
    Padded steps have g = 0 and beta = 0: they leave the state as it is."""
    run = _in_chunks(runs(segments, g.shape[:2]), chunk, heads=False)[:, None]  # [b, 1, chunks, chunk]
    q, k, v, g, beta = (_in_chunks(a, chunk) for a in _float32(q, k, v, g, beta))
    cum = jnp.cumsum(g, axis=-1)  # G_i
    # D_ij = exp(G_i - G_j) on and below the diagonal, within one document; elsewhere the exponent could be
    # positive, so it is masked before the exponential, not after
    lower = jnp.tril(jnp.ones((chunk, chunk), bool)) & (run[..., :, None] == run[..., None, :])
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    strict = decay * (1.0 - jnp.eye(chunk))
    below = beta[..., None] * strict * jnp.einsum("...ik,...jk->...ij", k, k)  # A, the system's strict part
    # the tokens that continue the document the chunk's starting state belongs to (the one before the chunk)
    carried = jnp.where(run == _previous_run(run), jnp.exp(cum), 0.0)
    rhs = jnp.concatenate([beta[..., None] * v, (beta * carried)[..., None] * k], axis=-1)
    solved = unit_lower_inverse(below) @ rhs
    dv = v.shape[-1]
    return {"u": solved[..., :dv], "e": solved[..., dv:],
            "q_decayed": carried[..., None] * q,
            "scores": jnp.einsum("...ik,...jk->...ij", q, k) * decay,
            "k_to_end": jnp.where(run == run[..., -1:], jnp.exp(cum[..., -1:] - cum), 0.0)[..., None] * k,
            "chunk_decay": carried[..., -1]}


def _chunk_step(state: jax.Array, terms: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """One chunk from its starting state [b, h, dk, dv] -> (the state after it, its outputs [b, h, C, dv])."""
    deltas = terms["u"] - terms["e"] @ state
    out = terms["q_decayed"] @ state + terms["scores"] @ deltas
    state = terms["chunk_decay"][..., None, None] * state + jnp.swapaxes(terms["k_to_end"], -1, -2) @ deltas
    return state, out


def chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
            state: jax.Array | None = None, segments: jax.Array | None = None,
            chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """``recurrent``'s outputs and final state by chunks of ``chunk`` steps: matrix products within a chunk, a
    scan over the chunks."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    state = jnp.zeros((b, h, dk, dv), jnp.float32) if state is None else state.astype(jnp.float32)
    terms = chunk_terms(q, k, v, g, beta, segments, chunk)
    state, out = jax.lax.scan(_chunk_step, state, jax.tree.map(lambda a: jnp.moveaxis(a, 2, 0), terms))
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, -1, dv)[:, :, :t]  # [b, h, t, dv]
    return jnp.swapaxes(out, 1, 2).astype(v.dtype), state
