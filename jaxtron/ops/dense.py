"""Attention with whole score matrices, written out: the reference for windows and sinks.

Every visible key's scaled score and, with sinks, one more logit per head go through one float32 softmax; the
sink's share is dropped (its value is zero). ``jax.nn.dot_product_attention`` has no sinks, and its log-sum-exp
carries no gradient, so the XLA path of a model with sinks runs this instead. It holds [length, length] scores:
for CPU tests and short sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED = -1e30  # the score of a hidden key: finite, so that a query seeing no key gives zeros, not NaN


def visible(q_order: jax.Array, k_order: jax.Array, q_segments: jax.Array | None, k_segments: jax.Array | None,
            window: int = 0) -> jax.Array:
    """[b, tq, tk]: key j is visible to query i when it is not later (by ``*_order``, each token's position), lies
    in the same document, and with ``window`` > 0 is one of the ``window`` latest keys up to the query."""
    seen = k_order[:, None, :] <= q_order[:, :, None]
    if window:
        seen &= q_order[:, :, None] - k_order[:, None, :] < window
    if q_segments is not None:
        seen &= k_segments[:, None, :] == q_segments[:, :, None]
    return seen


def attention(q: jax.Array, k: jax.Array, v: jax.Array, seen: jax.Array, sinks: jax.Array | None = None,
              scale: float | None = None) -> jax.Array:
    """Grouped-query attention of q [b, tq, heads, d] over k, v [b, tk, kv_heads, d] where ``seen`` [b, tq, tk]
    says, with the sink logits ``sinks`` [heads] beside the keys. Scores and softmax in float32, the output in
    q's dtype; ``scale`` defaults to 1/sqrt(d)."""
    b, t, n, h = q.shape
    g = k.shape[2]
    scale = scale if scale is not None else 1.0 / h ** 0.5
    qg = q.reshape(b, t, g, n // g, h)
    scores = jnp.einsum("btgqh,bsgh->bgqts", qg, k, preferred_element_type=jnp.float32) * scale
    mask = seen[:, None, None]
    scores = jnp.where(mask, scores, MASKED)
    if sinks is not None:
        column = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, g, n // g, 1, 1), (*scores.shape[:-1], 1))
        weights = jax.nn.softmax(jnp.concatenate([scores, column], axis=-1), axis=-1)[..., :-1]
    else:
        weights = jax.nn.softmax(scores, axis=-1)
    weights = weights * mask  # a query that sees no key (a prompt's padding in generation) gets zeros
    out = jnp.einsum("bgqts,bsgh->btgqh", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, v.shape[-1]).astype(q.dtype)
