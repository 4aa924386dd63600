"""Mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE, DeepSeek-V3) with expert parallelism.

Routing runs in plain sharded jit: softmax over the router logits (float32), top-k, optional
renormalisation of the k weights, the load-balancing and z losses, and in capacity mode which assignments
fit. Those are means over the global batch, so they do not depend on the mesh. The routed rows then run through
their experts as ``models/experts.py`` describes, inside ``shard_map`` over every mesh axis.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.common.trace_state import FP8_RECIPE
from jaxtron.config.schema import ExecutionConfig, ModelConfig
from jaxtron.models.experts import (
    DOWN_AXES,
    GATE_UP_AXES,
    TOKEN_AXES,
    ExpertAxes,
    ExpertRun,
    ExpertWeights,
    experts_local,
    rank_in_row,
)
from jaxtron.models.layers import GatedActivation, compute_dtype, param
from jaxtron.models.mlp import MLP
from jaxtron.ops import exchange, grouped
from jaxtron.parallel.sharding import constrain, logical_to_spec, spec_axes

ROUTE_AXES = ("activation_batch", "activation_length", None)
BIAS_AXES = ("experts", "mlp")  # how the experts' gate and up biases enter the expert computation (split as weights)


# The XLA options of a program whose MoE blocks exchange rows between devices. XLA's GPU compiler schedules without
# its latency-hiding scheduler unless told, and the scheduler it uses instead put no GEMM between the start and the
# done of any exchange of Mixtral 8x7B's blocks run in 2 or 4 token chunks (expert=8, H100 target); with this option
# the exchanges of the backward pass and of some chunks run beside GEMMs, and the kernels between their starts and
# dones hide 32-55% of their time at the network's bandwidth instead of 9-16% (benchmarks/moe_overlap.md;
# tests/test_gpu_target.py checks the share).
COMPILER_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True}
# With token chunks (execution.moe_chunks > 1) one chunk's rows go out while another's come home, both beside a third
# chunk's GEMMs; XLA's GPU scheduler keeps one collective in flight at a time unless told otherwise, and then ran the
# forward pass's ways home one after another past the last GEMM. With two in flight, on the H100 target, Mixtral
# 8x7B (expert=8) at 4 chunks runs 30 of its 48 exchanges beside GEMMs instead of 18 (hiding 66% of their time at
# the network's bandwidth instead of 55%), at 2 chunks 14 of 24 instead of 6 (61% instead of 34%), and DeepSeek-V3
# (4 layers, fsdp=2 expert=8) at 2 chunks 8 of 12 instead of 5 (51% instead of 31%). With one chunk it hid less
# (Mixtral 29% instead of 32%, DeepSeek-V3 35% instead of 42%), so it is only set with chunks
# (benchmarks/moe_overlap_limit2.md beside benchmarks/moe_overlap.md).
CHUNKED_OPTIONS = {"xla_gpu_experimental_parallel_collective_overlap_limit": 2}


def compiler_options(cfg: ModelConfig, expert_shards: int, chunks: int = 1) -> dict[str, object]:
    """The XLA options of a program of this model whose experts are split ``expert_shards`` ways, each device's
    tokens running through them in ``chunks`` (``execution.moe_chunks``)."""
    if not (cfg.moe.num_experts and expert_shards > 1):
        return {}
    return {**COMPILER_OPTIONS, **(CHUNKED_OPTIONS if chunks > 1 else {})}


def budget_schedule(cfg: ModelConfig, expert_shards: int, schedule: str) -> bool:
    """Whether a GPU program of this model, its experts split ``expert_shards`` ways, compiles twice so that XLA's
    scheduler weighs its exchanges with the first compile's costs (``execution.moe_schedule``, metrics/schedule.py)."""
    return bool(compiler_options(cfg, expert_shards)) and schedule == "budget"


def capacity(cfg: ModelConfig, factor: float, length: int) -> int:
    """Slots per expert in each batch row (capacity mode, ``execution.capacity_factor``)."""
    return max(1, math.ceil(factor * length * cfg.moe.experts_per_token / cfg.moe.num_experts))


def route(cfg: ModelConfig, logits: jax.Array, row_capacity: int | None = None,
          bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Router logits [batch, length, experts] (float32) -> (expert ids [b, t, k], weights [b, t, k], stats).

    ``model.moe.router`` 'softmax' (Mixtral, Qwen3): the k largest probabilities. 'sigmoid' (DeepSeek-V3): sigmoid
    scores; the experts are chosen by score plus ``bias`` (the balancing bias, which gets no gradient), only among
    the ``router_top_groups`` groups whose best two biased scores sum highest, and weighted by their unbiased
    scores. Either way the weights are renormalised to sum to 1 when ``router_renormalize`` and multiplied by
    ``router_scale``.

    Dropped assignments (capacity mode: ``row_capacity`` slots per expert and row) get the id ``num_experts``
    and weight 0. Stats: ``aux_loss`` (1 when balanced: softmax, experts * sum_e load_e * mean_prob_e over the
    batch; sigmoid, the same per sequence with the scores normalised to sum to 1, averaged over sequences),
    ``z_loss`` (mean squared log-partition), ``load`` (fraction of the assignments each expert received, before
    capacity) and ``dropped`` (fraction of assignments over capacity).
    """
    num_experts, k = cfg.moe.num_experts, cfg.moe.experts_per_token
    if cfg.moe.router == "sigmoid":
        probs = jax.nn.sigmoid(logits)
        choice = probs + jax.lax.stop_gradient(bias) if bias is not None else probs
        if cfg.moe.router_groups > 1:
            by_router_group = choice.reshape(*choice.shape[:-1], cfg.moe.router_groups, -1)
            best = jnp.sum(_top_k(by_router_group, 2)[0], axis=-1)  # [b, t, groups]
            _, top_groups = _top_k(best, cfg.moe.router_top_groups)
            allowed = jnp.sum(jax.nn.one_hot(top_groups, cfg.moe.router_groups, dtype=jnp.int32), axis=-2) > 0
            choice = jnp.where(allowed[..., None], by_router_group, -jnp.inf).reshape(choice.shape)
        _, ids = _top_k(choice, k)
        weights = jnp.take_along_axis(probs, ids, axis=-1)
        if cfg.moe.router_renormalize:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    else:
        probs = jax.nn.softmax(logits, axis=-1)
        weights, ids = _top_k(probs, k)
        if cfg.moe.router_renormalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if cfg.moe.router_scale != 1.0:
        weights = weights * cfg.moe.router_scale
    chosen = jax.nn.one_hot(ids, num_experts, dtype=jnp.float32)  # [b, t, k, E]
    row_load = jnp.mean(jnp.sum(chosen, axis=2), axis=1) / k  # [b, E]
    load = jnp.mean(row_load, axis=0)
    if cfg.moe.router == "sigmoid":  # sequence-wise, as DeepSeek-V3's complementary balance loss
        shares = probs / jnp.sum(probs, axis=-1, keepdims=True)
        aux = num_experts * jnp.mean(jnp.sum(row_load * jnp.mean(shares, axis=1), axis=-1))
    else:
        aux = num_experts * jnp.sum(load * jnp.mean(probs, axis=(0, 1)))
    stats = {
        "aux_loss": aux,
        "z_loss": jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
        "load": load,
        "dropped": jnp.zeros((), jnp.float32),
    }
    if row_capacity is not None:
        keep = _within_capacity(chosen, row_capacity)
        ids = jnp.where(keep, ids, num_experts)
        weights = jnp.where(keep, weights, 0.0)
        stats["dropped"] = 1.0 - jnp.mean(keep.astype(jnp.float32))
    return ids, weights, stats


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k`` along the last axis of per-token values [batch, length, ...], run on each device's own
    tokens: left to XLA's partitioner, a TopK of a batch-split input gathered the whole batch's values onto
    every device (``tests/test_moe.py``). check_vma off for the pipeline stage's vmap, as in ``MoE._routed``."""
    if jax.sharding.get_abstract_mesh().empty:
        return jax.lax.top_k(x, k)
    spec = logical_to_spec(ROUTE_AXES[:2] + (None,) * (x.ndim - 2))
    return jax.shard_map(lambda a: tuple(jax.lax.top_k(a, k)), in_specs=spec, out_specs=(spec, spec),
                         check_vma=False)(x)


def _within_capacity(chosen: jax.Array, slots: int) -> jax.Array:
    """Which assignments [b, t, k] fit their expert's ``slots`` in their row: a token loses its second expert
    before another token loses its first."""
    return rank_in_row(chosen) < slots


class MoE(nnx.Module):
    """Router plus ``num_experts`` SwiGLU experts stored stacked along the logical axis ``experts``, and with
    ``shared_experts`` a SwiGLU every token goes through, run like a dense MLP (tensor-parallel, FP8 with
    ``execution.fp8``). The sigmoid router carries a balancing bias (logical axis ``bias``): no gradient reaches
    it, the train step moves it (``train.router_bias_rate``)."""

    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig, rngs: nnx.Rngs):
        d, f, e = cfg.embed_dim, cfg.resolved_expert_dim, cfg.moe.num_experts
        self.cfg, self.execution = cfg, execution
        self.router = param(rngs, (d, e), ("embed", None), cfg.init_std)
        self.router_bias = nnx.Param(jnp.zeros((e,), jnp.float32), out_sharding=("bias",)) \
            if cfg.moe.router == "sigmoid" and cfg.moe.balance_bias else None
        # gpt-oss: a learned bias on the router's logits, and biases on each expert's projections
        self.router_logit_bias = nnx.Param(jnp.zeros((e,), jnp.float32), out_sharding=("bias",)) \
            if cfg.moe.router_logit_bias else None
        self.wi_gate = param(rngs, (e, d, f), GATE_UP_AXES, cfg.init_std)
        self.wi_up = param(rngs, (e, d, f), GATE_UP_AXES, cfg.init_std)
        self.wo = param(rngs, (e, f, d), DOWN_AXES, cfg.init_std / math.sqrt(2 * cfg.num_layers))
        zeros = (lambda shape: nnx.Param(jnp.zeros(shape, jnp.float32), out_sharding=("experts", "bias"))) \
            if cfg.moe.expert_bias else (lambda shape: None)
        self.wi_gate_bias, self.wi_up_bias, self.wo_bias = zeros((e, f)), zeros((e, f)), zeros((e, d))
        self.shared = MLP(cfg, execution, rngs, cfg.moe.shared_experts * f) if cfg.moe.shared_experts else None
        # Qwen3.5: each token's shared-expert output scaled by sigmoid of its own projection of the input
        self.shared_gate = param(rngs, (d,), ("embed",), cfg.init_std) if cfg.moe.shared_gate else None

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [batch, length, embed] -> (output of the same shape, routing stats; see ``route``)."""
        cfg = self.cfg
        capacity_mode = self.execution.moe_mode == "capacity"
        row_capacity = capacity(cfg, self.execution.capacity_factor, x.shape[1]) if capacity_mode else None
        with jax.named_scope("router"):  # the step's budget labels kernels by these scopes (metrics/budget.py)
            logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), self.router[...])
            if self.router_logit_bias is not None:
                logits = logits + self.router_logit_bias[...]
            bias = self.router_bias[...] if self.router_bias is not None else None
            ids, weights, stats = route(cfg, logits, row_capacity, bias)
        with jax.named_scope("experts"):
            y, dropped = self._routed(constrain(x, TOKEN_AXES), ids, weights, row_capacity, FP8_RECIPE.get())
        if not capacity_mode:  # assignments that found no room in a receive buffer
            stats["dropped"] = dropped / ids.size
        if self.wo_bias is not None:  # each expert's output bias, weighted as its output is (none where dropped)
            routed = jnp.sum(jax.nn.one_hot(ids, cfg.moe.num_experts, dtype=jnp.float32) * weights[..., None], axis=2)
            y = y + jnp.einsum("bte,ed->btd", routed, self.wo_bias[...]).astype(y.dtype)
        if self.shared is not None:
            shared = self.shared(x)[0]
            if self.shared_gate is not None:
                gate = jnp.einsum("btd,d->bt", x, self.shared_gate[...].astype(x.dtype))
                shared = shared * jax.nn.sigmoid(gate)[..., None]
            y = y + shared
        return y, stats

    def _routed(self, x: jax.Array, ids: jax.Array, weights: jax.Array, row_capacity: int | None,
                recipe: str | None) -> tuple[jax.Array, jax.Array]:
        """-> (outputs, assignments a receive buffer dropped, over all devices); ``recipe``: the FP8 recipe of the
        expert GEMMs, or None."""
        fp8 = recipe is not None
        cfg, dt = self.cfg, compute_dtype(self.execution)
        ids, weights = constrain(ids, ROUTE_AXES), constrain(weights, ROUTE_AXES)
        matrices = [w[...].astype(dt) for w in (self.wi_gate, self.wi_up, self.wo)]
        biases = [] if self.wi_gate_bias is None else [constrain(b[...].astype(dt), BIAS_AXES)
                                                      for b in (self.wi_gate_bias, self.wi_up_bias)]
        execution = self.execution
        run = ExpertRun(grouped.resolve(execution.expert_gemm, fp8),
                        exchange.resolve(execution.moe_exchange, execution.moe_receive_factor,
                                         execution.moe_node_shards),
                        execution.moe_receive_factor, fp8, execution.moe_chunks, execution.moe_node_shards,
                        GatedActivation.of(cfg), cfg.moe.scale_input, recipe or "tensorwise")
        if jax.sharding.get_abstract_mesh().empty:
            return experts_local(x, ids, weights, ExpertWeights(*matrices, *biases), cfg.moe.num_experts,
                                 row_capacity, None, run)
        token_spec, route_spec = logical_to_spec(TOKEN_AXES), logical_to_spec(ROUTE_AXES)
        token_axes = spec_axes(token_spec, 0) + spec_axes(token_spec, 1)
        axes = ExpertAxes.from_rules()

        # check_vma off: under a pipeline stage's vmap (spmd_axis_name) the inputs vary over the stage axis while
        # the constants made inside do not, which the check refuses; every collective here is written explicitly
        def local(x, ids, weights, *weight_arrays):
            y, dropped = experts_local(x, ids, weights, ExpertWeights(*weight_arrays), cfg.moe.num_experts,
                                       row_capacity, axes, run)
            return y, jax.lax.psum(dropped, token_axes) if token_axes else dropped  # over the devices of other tokens

        weight_specs = [logical_to_spec(a) for a in (GATE_UP_AXES, GATE_UP_AXES, DOWN_AXES)] + \
            [logical_to_spec(BIAS_AXES)] * len(biases)
        y, dropped = jax.shard_map(local, in_specs=(token_spec, route_spec, route_spec, *weight_specs),
                                   out_specs=(token_spec, logical_to_spec(())), check_vma=False)(
            x, ids, weights, *matrices, *biases)
        return constrain(y, TOKEN_AXES), dropped
