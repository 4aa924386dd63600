"""GRPO's update on a batch of sampled completions (``rollouts.py`` makes the batch).

Each row is a prompt and one of its completions; ``loss_mask`` is 1 on the completion's tokens, ``advantages``
holds the row's reward normalized within its prompt's group (the same value on every token). The step computes
the log-probabilities of the parameters that sampled (``old_logps``) and of the reference once, then makes
``rl.updates`` optimizer updates. Each token's loss is

    -min(r A, clip(r, 1 - e, 1 + e) A) + kl * (exp(ref - new) - (ref - new) - 1),    r = exp(new - old),

the clipped surrogate with the k3 estimate of KL(new || reference). A completion's loss is its tokens' mean
(``rl.length_normalization``), else their sum over ``rl.max_new_tokens``; the batch's is the mean over rows.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxtron.config.post_training import RlConfig
from jaxtron.training.loss import token_weights
from jaxtron.training.preference import adapters_off, token_logps

Batch = dict[str, jax.Array]
MEANS = ("grpo/kl", "grpo/clip_fraction", "grpo/ratio", "loss", "grad_norm")  # averaged over a step's updates


def grpo_sums(params: Any, graphdef: Any, batch: Batch, rl: RlConfig,
              stack_runner: Any = None, chunks: int = 1) -> tuple[jax.Array, tuple]:
    """(the loss summed over rows, (that sum, the row count, the rows' token-mean metrics))."""
    new = token_logps(params, graphdef, batch, stack_runner, chunks)
    weights = token_weights(batch)
    ratio = jnp.exp(new - batch["old_logps"])
    advantages = batch["advantages"]
    clipped = jnp.clip(ratio, 1 - rl.clip, 1 + rl.clip) * advantages
    surrogate = jnp.minimum(ratio * advantages, clipped)
    per_token = -surrogate
    if rl.kl:
        gap = batch["reference_logps"] - new
        kl = jnp.exp(gap) - gap - 1  # k3: unbiased for KL(new || reference), never negative
        per_token = per_token + rl.kl * kl
    tokens = jnp.sum(weights, axis=-1)
    scale = jnp.maximum(tokens, 1.0) if rl.length_normalization else float(rl.max_new_tokens)
    total = jnp.sum(jnp.sum(per_token * weights, axis=-1) / scale)
    count = jnp.maximum(jnp.sum(weights), 1.0)
    token_mean = lambda x: jnp.sum(x * weights) / count
    metrics = {"grpo/clip_fraction": token_mean((clipped < ratio * advantages).astype(jnp.float32)),
               "grpo/ratio": token_mean(ratio),
               "grpo/kl": token_mean(kl) if rl.kl else jnp.zeros(())}
    return total, (total, jnp.asarray(weights.shape[0], jnp.float32), metrics)


def with_policy_logps(params: Any, reference: Any, graphdef: Any, batch: Batch, rl: RlConfig,
                      stack_runner: Any = None, chunks: int = 1) -> Batch:
    """The batch with the sampling parameters' log-probabilities (``old_logps``) and, with a KL penalty, the
    reference's (``reference``; None: the adapters off), computed once before a step's updates."""
    batch = dict(batch)
    batch["old_logps"] = jax.lax.stop_gradient(token_logps(params, graphdef, batch, stack_runner, chunks))
    if rl.kl:
        frozen = adapters_off(params) if reference is None else reference
        batch["reference_logps"] = jax.lax.stop_gradient(token_logps(frozen, graphdef, batch, stack_runner,
                                                                         chunks))
    return batch


def rollout_metrics(batch: Batch) -> dict[str, jax.Array]:
    """The batch's mean reward and reward spread within groups (their host values ride in the batch per token)."""
    return {"grpo/reward": jnp.mean(batch["rewards"]), "grpo/reward_std": jnp.mean(batch["group_stds"])}
