"""What the 1F1B loop (``one_f_one_b.py``) carries from one iteration to the next, and what an iteration's forward
phase hands its backward phase."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Carry(NamedTuple):
    """What the schedule's loop carries from one iteration to the next."""
    moving: tuple  # (hidden [S, ...], extras [S, ...]): each stage's next forward input
    back: jax.Array  # [S, ...]: each stage's next backward input (the gradient of its output)
    stash: tuple  # (period inputs [S, K, pc, ...], extras [S, K, ...]): the inputs kept for the backward
    grad_stack: list  # the staged weights' gradient sums [S, R, P, ...], float32, one per replica
    grad_rest: list  # the other parameters' [S, R, ...] (a zero [S, R] for each staged one)
    sums: tuple  # (cross-entropy sum, token count)
    stats_sum: dict  # each period's routing stats summed over the microbatches [S, V pc, ...]
    mtp_sum: tuple  # the prediction modules' (cross-entropy sums, routing stats), summed over the microbatches


class Forward(NamedTuple):
    """An iteration's forward phase: the stages' outputs, and the head's and loss's on the last one."""
    out: jax.Array  # [S, ...] each stage's output
    extras: Any  # [S, ...] the extras its input came with
    stats: dict  # [S, pc, ...] each period's routing stats
    period_inputs: jax.Array  # [S, pc, ...] each period's input, kept for the backward
    d_post: list  # the head's and loss's gradients of the parameters outside the stack, [S, R, ...]
    d_h: jax.Array  # [S, ...]: the loss's gradient of the last stage's output, on the last stage
    ce: jax.Array  # the finished microbatch's cross-entropy sum (zero if none finished)
    n: jax.Array  # and its token count
    mtp: tuple  # and its prediction modules' (cross-entropy sums, routing stats)


def zeros_of(shape, lead):
    """Zeros of each of ``shape``'s arrays with the dimensions ``lead`` in front."""
    return jax.tree.map(lambda a: jnp.zeros((*lead, *a.shape), a.dtype), shape)
