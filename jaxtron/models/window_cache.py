"""A local layer's KV cache in generation: a ring of ``window`` slots instead of one per position.

A local layer sees only the ``window`` latest positions, so the keys and values of older tokens are never read
again. The ring holds the latest ``window`` tokens of each row, each in slot position % window, with the slot's
position beside it (-1: empty). A call's queries attend over the ring's tokens and their own call's tokens
together, by position; then the call's latest ``window`` tokens are written in. A prompt longer than the window is
thus read whole while it is prefilled. A token of position -1 (a prompt's padding) is neither seen nor written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtron.ops import dense


def empty(shape: tuple[int, ...], window: int, dtype) -> dict[str, jax.Array]:
    """An empty ring for keys and values of ``shape`` [b, positions, kv_heads, head_dim]."""
    b, _, g, h = shape
    return {"k": jnp.zeros((b, window, g, h), dtype), "v": jnp.zeros((b, window, g, h), dtype),
            "slot_positions": jnp.full((b, window), -1, jnp.int32)}


def attend(cache: dict[str, jax.Array], q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
           window: int, sinks: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Queries q [b, t, heads, d] at ``positions`` [b, t] over the ring and this call's keys and values k, v
    [b, t, kv_heads, d], within the window -> (output [b, t, heads, d], the ring with this call's tokens in)."""
    f32 = jnp.float32
    keys = jnp.concatenate([cache["k"].astype(f32), k.astype(f32)], axis=1)
    values = jnp.concatenate([cache["v"].astype(f32), v.astype(f32)], axis=1)
    # a slot of this call's first position or later holds what this call writes again: its tokens take its place
    first = jnp.min(jnp.where(positions >= 0, positions, jnp.iinfo(jnp.int32).max), axis=1, keepdims=True)
    ring = jnp.where(cache["slot_positions"] < first, cache["slot_positions"], -1)
    key_positions = jnp.concatenate([ring, positions], axis=1)
    seen = dense.visible(positions, key_positions, None, None, window) & (key_positions >= 0)[:, None, :]
    out = dense.attention(q.astype(f32), keys, values, seen, sinks).astype(q.dtype)
    return out, write(cache, k, v, positions, window)


def write(cache: dict[str, jax.Array], k: jax.Array, v: jax.Array, positions: jax.Array,
          window: int) -> dict[str, jax.Array]:
    """The ring with the latest ``window`` of these tokens written into their slots (the others, and padding, are
    dropped: a slot keeps one token)."""
    latest = jnp.max(positions, axis=1, keepdims=True)
    kept = (positions >= 0) & (positions > latest - window)
    slots = jnp.where(kept, positions % window, window)  # past the ring: dropped
    rows = jnp.arange(positions.shape[0])[:, None]
    return {"k": cache["k"].at[rows, slots].set(k.astype(cache["k"].dtype), mode="drop"),
            "v": cache["v"].at[rows, slots].set(v.astype(cache["v"].dtype), mode="drop"),
            "slot_positions": cache["slot_positions"].at[rows, slots].set(positions, mode="drop")}
