"""The step's objective: ``loss_sums``, the loss of a batch as sums over its tokens (so that microbatches add up
to the whole batch exactly), with the MoE and multi-token-prediction terms; ``moe_metrics``, the routing stats'
means. The train step (``step.py``) and the pipeline schedules that run their own backward pass
(``pipeline/one_f_one_b.py``) both take it from here."""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config.schema import TrainConfig
from jaxtron.models.transformer import mtp_valid
from jaxtron.ops.cross_entropy import token_sums

Batch = dict[str, jax.Array]


def token_weights(batch: Batch) -> jax.Array:
    """Each target token's weight in the loss: the batch's ``loss_mask`` (float32), else ones."""
    weights = batch.get("loss_mask")
    return jnp.ones(batch["targets"].shape, jnp.float32) if weights is None else weights.astype(jnp.float32)


def moe_metrics(stats: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Routing stats stacked over MoE blocks -> their means over blocks (empty for a dense model)."""
    if not stats:
        return {}
    return {"moe_aux_loss": jnp.mean(stats["aux_loss"]), "moe_z_loss": jnp.mean(stats["z_loss"]),
            "moe_dropped_fraction": jnp.mean(stats["dropped"]), "expert_load": jnp.mean(stats["load"], axis=0),
            "block_load": stats["load"]}


class Objective(NamedTuple):
    """The loss's terms beside the cross-entropy, and how the head computes it (the ``train`` fields of the same
    names)."""
    z_loss: float = 0.0
    logit_chunks: int = 1  # the output head's vocabulary slices (``ops/cross_entropy.py``)
    router_aux_loss: float = 0.0
    router_z_loss: float = 0.0
    mtp_loss: float | None = None  # None: the prediction modules do not run (validation: their losses train only)

    @classmethod
    def training(cls, train: TrainConfig) -> Objective:
        return cls(train.z_loss, train.logit_chunks, train.router_aux_loss, train.router_z_loss, train.mtp_loss)

    def cross_entropy(self) -> Objective:
        """The cross-entropy alone (validation, and a schedule that only needs the stack's input)."""
        return Objective(logit_chunks=self.logit_chunks)


CROSS_ENTROPY = Objective()  # the cross-entropy alone, its head in one slice


def loss_sums(params: Any, graphdef: Any, batch: Batch, objective: Objective = CROSS_ENTROPY,
              stack_runner: Any = None, mtp_weights: jax.Array | None = None) -> tuple[jax.Array, tuple]:
    """(objective summed over tokens, (cross-entropy sum, token count, MoE and MTP metrics)).

    Sums rather than means so microbatches add up exactly to the large batch. The MoE auxiliary losses are
    means over the batch, so they enter the objective multiplied by the token count; so does multi-token
    prediction, ``objective.mtp_loss`` times the mean over depths of each depth's mean cross-entropy (``mtp_loss``
    metric).

    ``mtp_weights`` [depth]: the prediction modules' cross-entropy sums enter the objective times these instead (a
    1F1B schedule's microbatch, weighted by the whole batch's counts); the metrics then hold those sums
    (``mtp_sums``) and the routing stats of the modules' blocks (``mtp_stats``) in place of their means.
    """
    # a runner may shape the work outside it: a pipeline's stages split its rows (``Schedule.outside``)
    outside = getattr(stack_runner, "outside", None)
    z_loss, logit_chunks, router_aux_loss, router_z_loss, mtp_loss = objective
    with outside(batch["inputs"].shape[0]) if outside else contextlib.nullcontext():
        model = nnx.merge(graphdef, params)
        segments = batch.get("segment_ids")
        out = model(batch["inputs"], batch.get("positions"), segments, stack_runner=stack_runner,
                    mtp=mtp_loss is not None)
        weights = token_weights(batch)
        total, ce_sum, _ = token_sums(out.hidden, out.head, batch["targets"], weights, z_loss, logit_chunks)
        count = jnp.sum(weights)
        extra = {}
        if out.mtp_hidden:
            ce_k, valid_k = [], []
            for k, hidden in enumerate(out.mtp_hidden, start=1):
                valid = mtp_valid(weights, segments, k)
                ce_k.append(token_sums(hidden, out.head, jnp.roll(batch["targets"], -k, axis=1), valid, 0.0,
                                       logit_chunks)[0])
                valid_k.append(jnp.sum(valid))
            ce_k = jnp.stack(ce_k)
            if mtp_weights is not None:
                total += jnp.sum(mtp_weights * ce_k)
                return total, (ce_sum, count, {"mtp_sums": ce_k, "mtp_stats": out.stats})
            extra["mtp_loss"] = jnp.mean(ce_k / jnp.maximum(jnp.stack(valid_k), 1.0))
            total += count * mtp_loss * extra["mtp_loss"]
        moe = moe_metrics(out.stats)
        if moe:
            total += count * (router_aux_loss * moe["moe_aux_loss"] + router_z_loss * moe["moe_z_loss"])
        return total, (ce_sum, count, {**moe, **extra})
