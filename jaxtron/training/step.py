"""The pure train step: loss, gradients (with microbatch accumulation), optimizer update. No I/O."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxtron.metrics import schedule as gpu_schedule
from jaxtron.models import lora
from jaxtron.parallel.sharding import (
    BATCH_AXES,
    constrain,
    logical_names,
    replica_axes,
)
from jaxtron.parallel.state_sharding import constrain_variables
from jaxtron.training import grpo, preference
from jaxtron.training.loss import Objective, loss_sums
from jaxtron.training.optimizer import schedule_count
from jaxtron.training.pipeline.fill_drain import split_rows
from jaxtron.training.pipeline.replicas import Replicas
from jaxtron.training.state import Setup, TrainState
from jaxtron.training.working_copy import as_masters, master_shapes, working_copy

Batch = dict[str, jax.Array]


def balance_router_bias(params: Any, block_load: jax.Array, rate: float,
                        order: Sequence[int] | None = None) -> tuple[Any, jax.Array]:
    """Auxiliary-loss-free balancing: each MoE block's router bias moves ``rate`` up for the experts that got
    less than the mean load in this step and down for those that got more (``block_load`` [MoE blocks in the
    model's order, then the MTP modules' blocks, experts]). ``order``: the period each stored position of the MoE
    stack holds (``jaxtron.parallel.stages.storage_order``; None: natural); identity periods stay as they are.
    -> (params with the new biases, the mean over blocks of each bias's spread, max - min)."""
    params = jax.tree.map(lambda x: x, params)  # a new State; the old one stays as it was
    step = rate * jnp.sign(jnp.mean(block_load, axis=-1, keepdims=True) - block_load)
    spreads, first = [], 0
    stacks = [(params["moe_layers"]["mlp"], order)] + ([(params["mtp"]["block"]["mlp"], None)] if "mtp" in params
                                                         else [])
    for mlp, stack_order in stacks:
        bias = mlp["router_bias"]
        stored = np.arange(bias.shape[0]) if stack_order is None else np.asarray(stack_order)
        real = stored >= 0
        value = bias[...] + jnp.where(real[:, None], step[first + np.maximum(stored, 0)], 0.0)
        first += int(real.sum())
        mlp["router_bias"] = bias.replace(value)
        spreads.append(jnp.max(value[real], axis=-1) - jnp.min(value[real], axis=-1))
    return params, jnp.mean(jnp.concatenate(spreads))


def split_microbatches(batch: Batch, k: int, pairs: bool = False) -> Batch:
    """[B, ...] -> [k, B/k, ...]; microbatch j takes rows j, j+k, ... so no data crosses devices; with ``pairs``,
    pairs of rows j, j+k, ... so that each pair's two rows stay together (``preference.pair_rows``)."""
    if not pairs:
        return jax.tree.map(lambda x: split_rows(x, k), batch)
    split = jax.tree.map(lambda x: split_rows(x, k), preference.pair_rows(batch))
    return jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[3:]), split)


def objective(setup: Setup, reference: Any = None):
    """The step's loss function, ``f(params, batch=...) -> (objective sum, (loss sum, count, metrics))``:
    the language model's over tokens, or DPO's over pairs against ``reference`` (None: the adapters off)."""
    if setup.train.objective == "dpo":
        return functools.partial(preference.dpo_sums, graphdef=setup.graphdef, dpo=setup.dpo, reference=reference,
                                 stack_runner=setup.stack_runner, chunks=setup.train.logit_chunks)
    if setup.train.objective == "grpo":
        return functools.partial(grpo.grpo_sums, graphdef=setup.graphdef, rl=setup.rl, stack_runner=setup.stack_runner,
                                 chunks=setup.train.logit_chunks)
    return functools.partial(loss_sums, graphdef=setup.graphdef, objective=Objective.training(setup.train),
                             stack_runner=setup.stack_runner)


def gradients(setup: Setup, params: Any, batch: Batch, reference: Any = None):
    """(summed gradients, loss sum, count, metrics) of the whole batch: the cross-entropy over tokens with the MoE
    metrics, or DPO's loss over pairs with its own (``objective``). Gradients and sums are accumulated over
    microbatches in float32, the metrics averaged over them."""
    masters = params
    if setup.distributed_optimizer:  # the masters gathered once, in the compute dtype (``working_copy.py``)
        params = working_copy(setup.graphdef, masters)
    # a pipeline schedule that runs its own backward pass computes them (``Schedule.gradients``: the 1F1B ones); the
    # others are differentiated through
    own = None if setup.stack_runner is None else setup.stack_runner.gradients(setup, params, batch)
    if own is not None:
        return as_masters(own[0], masters), *own[1:]
    grads, ce_sum, count, moe = _differentiated(setup, params, masters, batch, reference)
    return as_masters(grads, masters), ce_sum, count, moe


def _differentiated(setup: Setup, params: Any, masters: Any, batch: Batch, reference: Any):
    """``gradients`` differentiated through the objective, of ``params`` (the masters or their working copy),
    accumulated over the microbatches in the masters' dtypes."""
    microbatches = setup.train.microbatches
    loss_fn = objective(setup, reference)
    params, frozen = lora.split(params)
    if frozen is not None:  # LoRA: gradients of the adapters alone; the base is a constant, with no gradient work
        loss_fn = functools.partial(lambda trainable, batch, f: f(lora.join(trainable, frozen), batch=batch),
                                    f=loss_fn)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if microbatches == 1:
        (_, (ce_sum, count, moe)), grads = grad_fn(params, batch=batch)
        return grads, ce_sum, count, moe

    micro_batches = split_microbatches(batch, microbatches, setup.train.objective == "dpo")
    first = jax.tree.map(lambda a: a[0], micro_batches)
    (_, sums), grads = jax.eval_shape(lambda: grad_fn(params, batch=first))
    grads = master_shapes(grads, masters)
    mesh = jax.sharding.get_abstract_mesh()
    # a dense model without a pipeline sums its gradients over the replicas once a step: each replica's rows run
    # apart (a vmap over the replicas, spmd over the mesh axes that split the rows and no weight), each
    # accumulating its own sums (``replica_axes``). Otherwise every microbatch's gradients are summed (the
    # distributed optimizer's accumulator holding only its shard: reduce-scattered onto it)
    axes = () if mesh.empty or sums[2] or setup.stack_runner is not None else replica_axes(params, dict(mesh.shape))
    if axes:
        return _accumulation_per_replica(grad_fn, params, micro_batches, grads, axes, microbatches)
    shard = (lambda tree: constrain_variables(tree, optimizer=True)) if setup.distributed_optimizer else (lambda t: t)

    def body(carry, micro):
        micro = {k: constrain(v, BATCH_AXES) for k, v in micro.items()}
        (_, sums), grads = grad_fn(params, batch=micro)
        return jax.tree.map(jnp.add, carry, (shard(as_masters(grads, masters)), *sums)), None

    init = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), (grads, *sums))
    init = (shard(init[0]), *init[1:])
    (grads, ce_sum, count, moe), _ = jax.lax.scan(body, init, micro_batches)
    return grads, ce_sum, count, jax.tree.map(lambda a: a / microbatches, moe)


def _accumulation_per_replica(grad_fn, params: Any, micro_batches: Batch, grads_shape: Any, axes: tuple[str, ...],
                              microbatches: int):
    """``gradients``' accumulation with each replica's rows apart (``replica_axes``): -> the same four values."""
    rows = Replicas(axes)
    names = [logical_names(v) for v in jax.tree.leaves(grads_shape, is_leaf=lambda x: isinstance(x, nnx.Variable))]
    treedef = jax.tree.structure(grads_shape)

    def body(carry, micro):
        micro = {k: constrain(v, BATCH_AXES) for k, v in micro.items()}
        (_, (ce, count, _)), grads = rows.map(lambda mb: grad_fn(params, batch=mb), (0,), micro)
        acc, ce_sum, n_sum = carry
        acc = rows.constrain([a + g.astype(a.dtype) for a, g in zip(acc, jax.tree.leaves(grads), strict=True)],
                             names)
        return (acc, ce_sum + jnp.sum(ce), n_sum + jnp.sum(count)), None

    zero = jnp.zeros((), jnp.float32)
    init = (rows.constrain([jnp.zeros((rows.count, *a.shape), a.dtype) for a in jax.tree.leaves(grads_shape)],
                           names), zero, zero)
    (acc, ce_sum, count), _ = jax.lax.scan(body, init, micro_batches)
    grads = jax.tree.unflatten(treedef, [jnp.sum(a, axis=0) for a in acc])  # the one sum over the replicas
    return grads, ce_sum, count, {}


def all_finite(tree: Any) -> jax.Array:
    """Whether every floating-point value in ``tree`` is finite (one boolean)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


_all_finite = jax.jit(all_finite)


def state_finite(state: TrainState) -> bool:
    """Whether every value of a (sharded) train state is finite: one read of the state, on the devices that hold
    it; every process gets the same answer."""
    return bool(_all_finite(state))


def train_step(setup: Setup, state: TrainState, batch: Batch,
               stop_votes: jax.Array | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update on one global batch; returns the new state and scalar metrics.

    ``stop_votes`` holds one flag per device (each process sets those of its own devices); their maximum comes
    back as ``metrics["stop_requested"]``, the same value on every process, so all processes agree on when to
    stop. ``metrics["nonfinite_stopped"]`` is the step that reached ``max_nonfinite_in_row`` (-1: none); from
    then on no update is applied. ``metrics["nonfinite_kind"]`` says what was not finite in this step (0: nothing,
    1: the loss, 2: the gradients, 3: both). ``metrics["learning_rate"]`` is the rate optax applied: its schedule
    count stops at skipped updates while ``state.step`` goes on. Whether the new state is finite is checked when
    it is saved (``state_finite``), not here: checking it here made XLA write both AdamW moments twice, into new
    buffers and then into the donated ones (15 ms and 7.8 GiB on Llama-3 8B's 8-layer step on one H200).
    """
    with lora.dropout(jax.random.fold_in(jax.random.key(setup.train.seed), state.step)):  # used by LoRA's dropout only
        # of the adapters alone in a LoRA run
        grads, ce_sum, count, moe = gradients(setup, state.params, batch, state.reference)
    trainable, frozen = lora.split(state.params)
    if setup.distributed_optimizer:  # each device reduces, then updates, only its shard of the moments
        grads = constrain_variables(grads, optimizer=True)
    block_load = moe.pop("block_load", None)
    grads = jax.tree.map(lambda g: g / count, grads)
    loss, grad_norm = ce_sum / count, optax.tree.norm(grads)
    learning_rate = setup.learning_rate(schedule_count(state.opt_state))  # read before the update counts this step
    with jax.named_scope("optimizer"):
        updates, opt_state = setup.tx.update(grads, state.opt_state, trainable)
        params = lora.join(optax.apply_updates(trainable, updates), frozen)
    if setup.distributed_optimizer:  # the updated masters stay split; the next step gathers its working copy
        params = constrain_variables(params, optimizer=True)
    bias_spread = None
    if setup.train.router_bias_rate:  # outside the gradients: the router bias gets none, and no optimizer update
        params, bias_spread = balance_router_bias(params, block_load, setup.train.router_bias_rate,
                                                  setup.layer_order)
    # a non-finite loss or gradient skips this update: the state stays as it was, and is counted
    loss_finite, grads_finite = jnp.isfinite(loss), jnp.isfinite(grad_norm)
    finite = loss_finite & grads_finite
    kind = (~loss_finite).astype(jnp.int32) + 2 * (~grads_finite).astype(jnp.int32)
    total, in_row, stopped = state.nonfinite[0], state.nonfinite[1], state.nonfinite[2]
    total, in_row = total + (~finite), jnp.where(finite, 0, in_row + 1)
    limit = setup.train.max_nonfinite_in_row
    if limit:
        stopped = jnp.where((stopped < 0) & (in_row >= limit), state.step + 1, stopped)
    apply = finite & (stopped < 0)  # a stopped run changes no more, however late the loop reads the flag
    keep = lambda new, old: jnp.where(apply, new, old)
    with jax.named_scope("optimizer"):
        params, opt_state = jax.tree.map(keep, params, state.params), jax.tree.map(keep, opt_state, state.opt_state)
    votes = jnp.zeros((), jnp.int32) if stop_votes is None else jnp.max(stop_votes)
    metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": learning_rate,
               "nonfinite_steps": total, "nonfinite_stopped": stopped.astype(jnp.int32), "stop_requested": votes,
               "nonfinite_kind": kind,
               **moe}
    if "expert_load" in moe:  # the most loaded expert's share relative to a perfectly balanced one (1: balanced)
        metrics["moe_max_load"] = jnp.max(moe["expert_load"]) * moe["expert_load"].shape[0]
    if bias_spread is not None:
        metrics["moe_bias_spread"] = bias_spread
    nonfinite = jnp.stack([total, in_row, stopped]).astype(jnp.int32)
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state, nonfinite=nonfinite,
                      reference=state.reference), metrics


def rollout_step(setup: Setup, state: TrainState, batch: Batch,
                 stop_votes: jax.Array | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
    """GRPO's step on a batch of sampled completions (``grpo.py``): the sampling parameters' and the reference's
    log-probabilities once, then ``rl.updates`` optimizer updates (``train_step`` each); one step of the run. The
    metrics are the updates' means where ``grpo.MEANS`` says so, the last update's otherwise."""
    policy = working_copy(setup.graphdef, state.params) if setup.distributed_optimizer else state.params
    batch = grpo.with_policy_logps(policy, state.reference, setup.graphdef, batch, setup.rl,
                                   setup.stack_runner, setup.train.logit_chunks)
    start, updates = state.step, []
    for _ in range(setup.rl.updates):  # unrolled: a few updates, each the whole batch
        state, metrics = train_step(setup, state, batch, stop_votes)
        updates.append(metrics)
    metrics = {**updates[-1], **{k: sum(m[k] for m in updates) / len(updates) for k in grpo.MEANS}}
    return state.replace(step=start + 1), {**metrics, **grpo.rollout_metrics(batch)}


def eval_step(setup: Setup, params: Any, batch: Batch, reference: Any = None) -> dict[str, jax.Array]:
    """A batch's metric sums and their ``count`` (no gradients): the summed cross-entropy over tokens
    (``eval/loss``), or DPO's sums over pairs (``preference.dpo_eval_sums``)."""
    if setup.train.objective == "dpo":
        return preference.dpo_eval_sums(params, setup.graphdef, batch, setup.dpo, reference, setup.stack_runner,
                                        setup.train.logit_chunks)
    _, (ce_sum, count, _) = loss_sums(params, setup.graphdef, batch, Objective.training(setup.train).cross_entropy(),
                                      stack_runner=setup.stack_runner)
    return {"eval/loss": ce_sum, "count": count}


def compile_train_step(setup: Setup, shardings: TrainState, batch_sharding, state: TrainState, batch: Batch,
                       stop_votes: jax.Array):
    """Ahead-of-time compiled ``train_step`` (state donated); returns (compiled, seconds spent compiling)."""
    step = functools.partial(train_step, setup)
    if setup.train.objective == "grpo":  # GRPO's step: the log-probabilities, then train_step rl.updates times
        step = functools.partial(rollout_step, setup)
    step_fn = jax.jit(step, in_shardings=(shardings, batch_sharding,
                                                                          stop_votes.sharding),
                      out_shardings=(shardings, None), donate_argnums=0)
    start = time.perf_counter()
    costs = gpu_schedule.for_devices(jax.devices()) if setup.budget_schedule else None
    lowered = step_fn.lower(state, batch, stop_votes)
    compiled = gpu_schedule.compile_scheduled(lowered, dict(setup.compiler_options), costs)
    return compiled, time.perf_counter() - start
