"""DPO's objective, and the log-probabilities RL shares: the policy's and the reference's summed log-probabilities
of each pair's two responses, and the loss ``-log sigmoid(beta * margin)`` over pairs
(``config.post_training.DpoConfig``).

A batch holds pairs as neighbouring rows (``jaxtron.data.pairs``): row 2p is pair p's chosen response, row 2p + 1
its rejected one. Sums over pairs, like the language model's sums over tokens, so that microbatches of whole
pairs add up to the batch exactly; the pair count stands where the token count does."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config.post_training import DpoConfig
from jaxtron.models import lora
from jaxtron.ops.cross_entropy import target_log_probs
from jaxtron.training.loss import token_weights

Batch = dict[str, jax.Array]


def token_logps(params: Any, graphdef: Any, batch: Batch, stack_runner: Any = None, chunks: int = 1) -> jax.Array:
    """[rows, length] float32: each target's log-probability under the model (every position, masked or not), the
    logits made ``chunks`` (train.logit_chunks) slices of the sequence at a time."""
    model = nnx.merge(graphdef, params)
    out = model(batch["inputs"], batch.get("positions"), batch.get("segment_ids"), stack_runner=stack_runner)
    return target_log_probs(out.hidden, out.head, batch["targets"], chunks)


def sequence_logps(params: Any, graphdef: Any, batch: Batch, stack_runner: Any = None, chunks: int = 1) -> jax.Array:
    """[rows] float32: each row's summed log-probability of its targets where ``loss_mask`` is 1."""
    return jnp.sum(token_logps(params, graphdef, batch, stack_runner, chunks) * token_weights(batch), axis=-1)


def pair_rows(batch: Batch) -> Batch:
    """[2P, ...] -> [P, 2, ...]: each pair's two rows together (a reshape: rows stay on their devices)."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // 2, 2, *x.shape[1:]), batch)


def unpair_rows(batch: Batch) -> Batch:
    """The inverse of ``pair_rows``."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] * 2, *x.shape[2:]), batch)


def adapters_off(params: Any) -> Any:
    """A LoRA model's parameters with every adapter at zero: the base model exactly, DPO's reference."""
    trainable, frozen = lora.split(params)
    return lora.join(jax.tree.map(jnp.zeros_like, trainable), frozen)


def dpo_sums(params: Any, graphdef: Any, batch: Batch, dpo: DpoConfig, reference: Any,
             stack_runner: Any = None, chunks: int = 1) -> tuple[jax.Array, tuple]:
    """(the loss summed over pairs, (that sum, the pair count, the pairs' mean metrics)); ``reference``: the
    reference model's parameters (None: ``params`` with their adapters off)."""
    policy = sequence_logps(params, graphdef, batch, stack_runner, chunks).reshape(-1, 2)
    frozen = adapters_off(params) if reference is None else reference
    base = jax.lax.stop_gradient(sequence_logps(frozen, graphdef, batch, stack_runner, chunks)).reshape(-1, 2)
    rewards = dpo.beta * (policy - base)  # DPO's implicit rewards, [pairs, (chosen, rejected)]
    logits = rewards[:, 0] - rewards[:, 1]
    e = dpo.label_smoothing
    losses = -(1 - e) * jax.nn.log_sigmoid(logits) - e * jax.nn.log_sigmoid(-logits)
    total, pairs = jnp.sum(losses), jnp.asarray(logits.shape[0], jnp.float32)
    metrics = {"dpo/margin": jnp.mean(logits), "dpo/train_accuracy": jnp.mean(logits > 0),
               "dpo/chosen_logp": jnp.mean(policy[:, 0]), "dpo/rejected_logp": jnp.mean(policy[:, 1]),
               "dpo/chosen_reward": jnp.mean(rewards[:, 0]), "dpo/rejected_reward": jnp.mean(rewards[:, 1])}
    return total, (total, pairs, metrics)


def dpo_eval_sums(params: Any, graphdef: Any, batch: Batch, dpo: DpoConfig, reference: Any,
                  stack_runner: Any = None, chunks: int = 1) -> dict[str, jax.Array]:
    """Held-out pairs' sums: the loss, pairs ranked right (``dpo/accuracy``), the margin; and their count."""
    total, (_, pairs, metrics) = dpo_sums(params, graphdef, batch, dpo, reference, stack_runner, chunks)
    return {"eval/loss": total, "dpo/accuracy": metrics["dpo/train_accuracy"] * pairs,
            "eval/dpo_margin": metrics["dpo/margin"] * pairs, "count": pairs}
