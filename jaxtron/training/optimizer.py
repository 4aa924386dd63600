"""The optimizers, with linear warmup and cosine decay, global-norm clipping, no weight decay on norms or biases.

- ``adamw``: AdamW for every parameter.
- ``muon``: the blocks' matrices (attention, MLP and expert projections, latent projections) get Nesterov momentum
  orthogonalized by Newton-Schulz iterations (optax's ``scale_by_muon``), each matrix whole: the logical axis names
  say which of a weight's dimensions are its inputs and outputs (``muon_dimensions``) and which stack layers or
  experts (a batch of matrices); each update is scaled to ``muon_rms`` x sqrt(max(fan in, fan out)), the RMS of
  AdamW's updates, so that AdamW's learning rate and weight decay carry over (as Moonlight matches them). The
  embedding, the head, norms, biases and routers keep AdamW.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers, scale_by_muon
from optax.contrib._muon import orthogonalize_via_newton_schulz

from jaxtron.config.schema import OptimizerConfig
from jaxtron.parallel.sharding import constrain, logical_names
from jaxtron.parallel.state_sharding import from_whole_matrices, to_whole_matrices

# logical axes that stack matrices (a batch of matrices, each orthogonalized on its own), and axes of weights that
# are no block matrix (AdamW's: the vocabulary's rows, norms, biases, and the router's unnamed expert scores)
STACKING = frozenset({"layers", "unstaged_layers", "stages", "experts"})
NOT_A_MATRIX = frozenset({"vocab", "norm", "bias", None})


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
    the train state's step goes on, so the learning rate applied is ``schedule(schedule_count(opt_state))``.
    (Muon's two parts, the matrices' and AdamW's, count alike.)"""
    found = [value for path, value in optax.tree_utils.tree_get_all_with_path(opt_state, "count")
             if getattr(path[-1], "tuple_name", "") == "ScaleByScheduleState"]
    if not found:
        raise ValueError("found no learning-rate schedule count in the optimizer state")
    return found[0]


def muon_dimensions(variable: nnx.Variable) -> MuonDimensionNumbers | None:
    """How Muon reads a parameter as matrices (``matrix_dimensions`` of its logical names)."""
    return matrix_dimensions(tuple(logical_names(variable)))


def matrix_dimensions(names: tuple[str | None, ...]) -> MuonDimensionNumbers | None:
    """How Muon reads a parameter of these logical names as matrices: the axes of ``STACKING`` are a batch; of the
    rest, an output projection's (whose last axis is ``embed``) are its inputs but the last, any other weight's
    inputs are its first axis ([embed, heads, head_dim] is one matrix of embed rows). None: AdamW's (fewer than two
    matrix axes, or one of ``NOT_A_MATRIX``)."""
    matrix = [i for i, name in enumerate(names) if name not in STACKING]
    if len(matrix) < 2 or NOT_A_MATRIX & {names[i] for i in matrix}:
        return None
    if names[matrix[-1]] == "embed":
        return MuonDimensionNumbers(tuple(matrix[:-1]), (matrix[-1],))
    return MuonDimensionNumbers((matrix[0],), tuple(matrix[1:]))


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _each_matrix(updates: Any, params: Any, fn: Callable[[Any, nnx.Variable], Any]) -> Any:
    """``fn(update, parameter)`` for each of Muon's updates (a Variable, or its array), given the parameter's Variable
    (its names and shape); the other parameters' places (``optax.MaskedNode``) as they are."""
    return jax.tree.map(lambda u, v: u if isinstance(u, optax.MaskedNode) else fn(u, v), updates, params,
                        is_leaf=lambda x: _is_variable(x) or isinstance(x, optax.MaskedNode))


def _scale_to_rms(rms: float, params: Any) -> optax.GradientTransformation:
    """Each orthogonalized update times ``rms`` x sqrt(max(fan in, fan out)) of its matrix."""
    def scale(update, variable):
        dims = muon_dimensions(variable)
        fan_in = math.prod(variable.shape[i] for i in dims.reduction_axis)
        fan_out = math.prod(variable.shape[i] for i in dims.output_axis)
        return jax.tree.map(lambda u: u * (rms * math.sqrt(max(fan_in, fan_out))), update)

    def update(updates, state, params_now=None):
        del params_now
        return _each_matrix(updates, params, scale), state
    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def _laid_out(tree: Any, params: Any, how: str) -> Any:
    """Muon's updates (or values shaped so) laid out for their orthogonalization, each device whole matrices of its
    share of a stack (``how='whole'``: ``state_sharding.to_whole_matrices``), from there back to their
    parameters' layout and shape ('back'), or held in that layout ('kept'); as they are without a mesh."""
    def one(update, variable):
        names, dims = tuple(logical_names(variable)), muon_dimensions(variable)
        matrix = (*dims.reduction_axis, *dims.output_axis)
        if how == "kept":
            return jax.tree.map(lambda u: constrain(u, names), update)
        if how == "back":
            return jax.tree.map(lambda u: from_whole_matrices(u, names, matrix, variable.shape), update)
        return jax.tree.map(lambda u: to_whole_matrices(u, names, matrix), update)
    return _each_matrix(tree, params, one)


def _orthogonalized_momentum(cfg: OptimizerConfig, params: Any, dimensions: Callable[[Any], Any]
                             ) -> optax.GradientTransformation:
    """optax's ``scale_by_muon`` (Nesterov momentum, then Newton-Schulz), with its state and arithmetic, but laid
    out for a mesh: the momentum is kept and updated where the gradient is (the parameters' layout), and only its
    Nesterov blend moves to whole matrices (``_laid_out``), and the orthogonalized update back: an all-to-all each
    way per sharded matrix dimension (moving the gradient, the momentum and the update, and the momentum back, made
    five), and an all-gather of the update over the axes that leave the parameter whole (data: their devices each
    orthogonalize a share of the matrices, not all of them; benchmarks/muon_plan.md)."""
    reference = scale_by_muon(ns_steps=cfg.muon_steps, beta=cfg.muon_momentum, eps=cfg.eps, nesterov=True,
                              weight_dimension_numbers=dimensions)
    beta = cfg.muon_momentum

    def update(updates, state, params_now=None):
        del params_now
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        blend = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                             optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                             optax.tree.bias_correction(updates, beta, count))
        # made (in the Newton-Schulz GEMMs' precision) where the momentum is, then moved: XLA would otherwise move
        # both of its terms
        blend = _laid_out(_laid_out(optax.tree.cast(blend, cfg.muon_dtype), params, "kept"), params, "whole")
        orthogonal = jax.tree.map(
            lambda x, dims: orthogonalize_via_newton_schulz(x, state.ns_coeffs.astype(x.dtype), cfg.muon_steps,
                                                            eps=cfg.eps, dimension_numbers=dims),
            blend, dimensions(blend), is_leaf=lambda x: isinstance(x, MuonDimensionNumbers))
        return optax.tree.cast(_laid_out(orthogonal, params, "back"), jnp.float32), state._replace(count=count, mu=mu)
    return optax.GradientTransformation(reference.init, update)


def _muon(cfg: OptimizerConfig, schedule, params: Any) -> optax.GradientTransformation:
    """Muon for the parameters ``muon_dimensions`` reads as matrices, AdamW for the others."""
    labels = jax.tree.map(lambda v: "muon" if muon_dimensions(v) else "adamw", params, is_leaf=_is_variable)

    def dimensions(updates):  # the masked updates' tree, each matrix's update (or its Variable) its dimension numbers
        def one(update, variable):
            dims = muon_dimensions(variable)
            return update.replace(dims) if _is_variable(update) else dims
        return _each_matrix(updates, params, one)

    matrices = optax.chain(
        _orthogonalized_momentum(cfg, params, dimensions),
        _scale_to_rms(cfg.muon_rms, params),
        optax.add_decayed_weights(cfg.weight_decay),
        optax.scale_by_learning_rate(schedule))
    rest = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                       mask=decay_mask(params))
    return optax.partition({"muon": matrices, "adamw": rest}, labels)


def make_optimizer(cfg: OptimizerConfig, total_steps: int, params: Any) -> optax.GradientTransformation:
    schedule = learning_rate_schedule(cfg, total_steps)
    if cfg.name == "muon":
        update = _muon(cfg, schedule, params)
    else:
        update = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             mask=decay_mask(params))
    if cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), update)
    return update
