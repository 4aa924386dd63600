"""AdamW with linear warmup and cosine decay, global-norm clipping, no weight decay on norms."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtron.config.schema import OptimizerConfig
from jaxtron.parallel.sharding import logical_names


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> Callable[[jax.Array], jax.Array]:
    """lr(step) for step = 0, 1, ...: linear warmup reaching the peak at step warmup-1, then a cosine that
    reaches min_lr_ratio * peak at the last step (decay_steps - 1, by default train.steps - 1)."""
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warmup = cfg.warmup_steps
    decay_end = cfg.decay_steps or total_steps

    top, bottom = max(warmup - 1, 0), decay_end - 1  # the steps that use the peak and the floor

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * (step + 1) / max(warmup, 1)
        progress = jnp.clip((step - top) / max(bottom - top, 1), 0.0, 1.0)
        cosine = floor + (peak - floor) * 0.5 * (1 + jnp.cos(math.pi * progress))
        return jnp.where(step < warmup, warm, cosine)

    return schedule


def decay_mask(params: Any) -> Any:
    """True for parameters that get weight decay: everything but norm scales and biases."""
    return jax.tree.map(lambda v: not {"norm", "bias"} & set(logical_names(v)), params,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def schedule_count(opt_state: Any) -> jax.Array:
    """The step count optax's learning-rate schedule reads: it stops at skipped (non-finite) updates, where
    the train state's step goes on, so the learning rate applied is ``schedule(schedule_count(opt_state))``."""
    found = [value for path, value in optax.tree_utils.tree_get_all_with_path(opt_state, "count")
             if getattr(path[-1], "tuple_name", "") == "ScaleByScheduleState"]
    if len(found) != 1:
        raise ValueError(f"expected one learning-rate schedule count in the optimizer state, found {len(found)}")
    return found[0]


def make_optimizer(cfg: OptimizerConfig, total_steps: int, params: Any) -> optax.GradientTransformation:
    schedule = learning_rate_schedule(cfg, total_steps)
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=decay_mask(params))
    if cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
    return adamw
