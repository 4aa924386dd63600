"""The model cut at its layer stack, for schedules that run the stack themselves (``one_f_one_b.py``): stack
runners that hand the stack's input out (``Capture``) or take its output in (``Replace``), so that the train step's
own loss computes what comes before the stack and what comes after it (``CutModel``, a microbatch at a time)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxtron.models.stack import scan_stack, without_remat
from jaxtron.models.transformer import mtp_valid
from jaxtron.parallel.sharding import BATCH_AXES, constrain
from jaxtron.training.loss import Objective, loss_sums, token_weights
from jaxtron.training.pipeline.fill_drain import split_rows

Batch = dict[str, jax.Array]


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


class CutModel:
    """The train step's loss cut at the layer stack, one microbatch at a time: ``pre`` up to the stack (``Capture``),
    ``post`` from it (``Replace``), with the objective's weights of the whole batch."""

    def __init__(self, setup, params: Any, batch: Batch):
        self.setup = setup
        m_ = setup.stack_runner.microbatches
        self.microbatches = m_
        self.micro = jax.tree.map(lambda a: split_rows(a, m_), batch)  # [M, b, ...]
        weights = token_weights(batch)
        self.count = jnp.sum(weights)
        self.objective = Objective.training(setup.train)
        # the prediction modules run with the head, a microbatch at a time: each depth's cross-entropy sum enters
        # the objective with the weight the whole batch gives it (the token count x mtp_loss over the depths and
        # over the positions the depth scores in the whole batch), so the microbatches add up to the fill-drain
        # objective
        self.depth = depth = jax.tree.leaves(params["mtp"])[0].shape[0] if "mtp" in params else 0
        self.valid_k = jnp.stack([jnp.sum(mtp_valid(weights, batch.get("segment_ids"), k))
                                  for k in range(1, depth + 1)]) if depth else jnp.zeros((0,), jnp.float32)
        self.mtp_weights = self.count * setup.train.mtp_loss / (max(depth, 1) * jnp.maximum(self.valid_k, 1.0))
        self.coefficient = {"aux_loss": setup.train.router_aux_loss, "z_loss": setup.train.router_z_loss}
        self.scale_blocks = None  # each MoE block's stats' weight, once the stack is known (``weigh_blocks``)

    def weigh_blocks(self, blocks: int) -> None:
        """The MoE losses' weight: the token count times the coefficient over (MoE blocks x microbatches)."""
        self.scale_blocks = self.count / (blocks * self.microbatches)

    def pick(self, t) -> Batch:
        """Microbatch ``t`` (clipped into range)."""
        return {k: constrain(jax.lax.dynamic_index_in_dim(v, jnp.clip(t, 0, self.microbatches - 1), 0, False),
                             BATCH_AXES) for k, v in self.micro.items()}

    def pre(self, p, mb):
        """-> (the stack's input, its extras, its periods, body) of microbatch ``mb``; the body's blocks without
        checkpoints (each period's backward runs right after its forward is recomputed)."""
        capture = Capture()
        with without_remat():
            loss_sums(p, self.setup.graphdef, mb, self.objective.cross_entropy(), stack_runner=capture)
        if capture.seen is None:
            raise ValueError("the model has no stacked blocks for the 1f1b schedule to run")
        body, x, stack, extras = capture.seen
        return x, extras, stack, body

    def post(self, p, h, mb):
        """-> (the objective's sums of the head, the loss and the prediction modules, (cross-entropy sum, token
        count, the modules' cross-entropy sums [depth], their blocks' routing stats [depth, ...])) of ``h``, the
        stack's output."""
        # the routing losses enter through the stats' cotangent (``OneFOneB.stats_cotangent``), not here
        terms = self.objective._replace(router_aux_loss=0.0, router_z_loss=0.0,
                                        mtp_loss=self.objective.mtp_loss if self.depth else None)
        objective, (ce, n, extra) = loss_sums(p, self.setup.graphdef, mb, terms, stack_runner=Replace(h),
                                              mtp_weights=self.mtp_weights)
        mtp_stats = extra.get("mtp_stats", {})
        # their MoE losses, weighted as the stack's blocks' are (``OneFOneB.stats_cotangent``)
        objective += sum(self.scale_blocks * self.coefficient.get(k, 0.0) * jnp.sum(v) for k, v in mtp_stats.items())
        return objective, (ce, n, extra.get("mtp_sums", jnp.zeros((0,), jnp.float32)), mtp_stats)
