"""Attention sinks (gpt-oss), folded in after a flash kernel.

A sink is one more logit s per head beside the keys, whose value is zero: it takes a share of the softmax and gives
nothing back. With the kernel's output O and log-sum-exp L of one query, the sink's softmax is the kernel's scaled
by the share the keys keep: ``O' = O * sigmoid(L - s)``. So any kernel that returns L runs unchanged.

The gradient goes through both O and L. ``with_sinks`` writes it for kernels whose backward takes the output and
statistics it should differentiate (flash attention's backward, cuDNN's among them). Given the sunk output O' and
the cotangent G of O', that backward needs the cotangent of O, which is G * sigmoid(L - s), and the softmax's
row term D = sum(dO * O) less the cotangent of L, sigmoid * (1 - sigmoid) * sum(G * O). Both make sigmoid^2 * sum(G
* O), which is the backward's own D when it is given O' in place of O. So the kernel's backward
runs as it is, on O' and the scaled cotangent, and the sink's gradient is -sum((1 - sigmoid) * sum(G * O')).
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# the checkpoint names of the sunk output and the kernel's log-sum-exp, which the backward needs: a remat policy that
# keeps them (models/stack.py's attention outputs) runs the kernel's forward once
OUTPUT_NAME, STATS_NAME = "sinks_out", "sinks_lse"


class StatsKernel(Protocol):
    """A flash kernel that returns its softmax statistics and differentiates given the output to use."""

    def forward(self, q, k, v, extras) -> tuple[jax.Array, jax.Array]:
        """-> (output [b, t, heads, d], natural log-sum-exp of the scaled scores [b, t, heads], float32)."""

    def backward(self, q, k, v, extras, out, lse, d_out) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Gradients of q, k, v given the output ``out`` and statistics ``lse`` to differentiate and ``d_out``."""


def share(lse: jax.Array, sinks: jax.Array) -> jax.Array:
    """[b, t, heads] float32: the share of the softmax the keys keep beside each head's sink logit."""
    return jax.nn.sigmoid(lse.astype(jnp.float32) - sinks.astype(jnp.float32))


def fold(out: jax.Array, lse: jax.Array, sinks: jax.Array) -> jax.Array:
    """The output of attention with sinks, from the output ``out`` and log-sum-exp ``lse`` of attention without:
    plain operations, differentiated by autodiff (the blockwise kernel's gradient takes the log-sum-exp's)."""
    return (out.astype(jnp.float32) * share(lse, sinks)[..., None]).astype(out.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def with_sinks(kernel: StatsKernel, q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array,
               extras: tuple) -> jax.Array:
    """Attention of ``kernel`` (queries q [b, t, heads, d], keys and values k, v) with the sink logits ``sinks``
    [heads] folded in; ``extras`` are the kernel's other inputs (no gradient)."""
    out, lse = kernel.forward(q, k, v, extras)
    return fold(out, lse, sinks)


def _forward(kernel, q, k, v, sinks, extras):
    out, lse = kernel.forward(q, k, v, extras)
    lse = checkpoint_name(lse, STATS_NAME)
    kept = share(lse, sinks)
    sunk = checkpoint_name((out.astype(jnp.float32) * kept[..., None]).astype(out.dtype), OUTPUT_NAME)
    return sunk, (q, k, v, sinks, extras, sunk, lse, kept)


def _backward(kernel, res, g):
    q, k, v, sinks, extras, sunk, lse, kept = res
    d_out = (g.astype(jnp.float32) * kept[..., None]).astype(q.dtype)
    dq, dk, dv = kernel.backward(q, k, v, extras, sunk, lse, d_out)
    per_row = jnp.sum(g.astype(jnp.float32) * sunk.astype(jnp.float32), axis=-1)  # [b, t, heads]
    d_sinks = -jnp.sum((1.0 - kept) * per_row, axis=(0, 1)).astype(sinks.dtype)
    return dq, dk, dv, d_sinks, jax.tree.map(lambda _: None, extras)


with_sinks.defvjp(_forward, _backward)
