"""The model cut at its layer stack, for schedules that run the stack themselves (``one_f_one_b.py``): stack
runners that hand the stack's input out (``Capture``) or take its output in (``Replace``), so that the train step's
own loss computes what comes before the stack and what comes after it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtron.models.stack import scan_stack


def _zero_stats(body, x, stack, extras, blocks: int | None = None):
    """Zero routing stats shaped as the stack's (with ``blocks`` leading entries in place of its blocks)."""
    stats = jax.eval_shape(lambda: scan_stack(body, x, stack, extras))[1]
    return jax.tree.map(lambda s: jnp.zeros(s.shape if blocks is None else (blocks, *s.shape[1:]), s.dtype), stats)


class Capture:
    """A stack runner that runs nothing: it records the body, the stack's input, its periods and extras, and hands
    the input on unchanged (with zero stats of the right shape)."""

    def __init__(self):
        self.seen: tuple | None = None

    def __call__(self, body, x, stack, extras):
        if self.seen is not None:
            raise ValueError("the 1f1b schedule runs one group of stacked blocks")
        self.seen = (body, x, stack, extras)
        return x, _zero_stats(body, x, stack, extras)


class Replace:
    """A stack runner that returns ``hidden`` as the stack's output, with stats of no blocks (the schedule counts
    the stack's MoE losses; the prediction modules' stats, which the model appends, stay theirs alone)."""

    def __init__(self, hidden: jax.Array):
        self.hidden = hidden

    def __call__(self, body, x, stack, extras):
        return self.hidden, _zero_stats(body, x, stack, extras, blocks=0)
