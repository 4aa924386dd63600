"""The pipeline schedule: circular fill-drain over microbatches inside one SPMD program.

The model's scanned stack holds N periods (a period is one block, or ``moe_every`` blocks of an MoE model). On
S stages with V virtual stages, each stage holds N / S periods, used in V rounds of P = N / (S * V): a microbatch
passes stages 0..S-1 in round 0, then again in round 1, and so on, so period (r * S + s) * P + p runs on stage s
in round r. The stack is kept stage-major (``Schedule.order``): stage s's periods are one contiguous block,
which the rules table's cut of the ``layers`` axis over the ``pipeline`` mesh axis gives each stage without
moving parameters. With V = 1 this is the natural order.

Each iteration every stage applies its P periods to the microbatch it holds (one program, vmapped over the
stage dimension, which the rules table shards over the pipeline axis; the loop runs period by period, P steps an
iteration, so that the backward pass adds each period's weight gradients into one accumulator and XLA sums them
over the batch's axes once after the loop), then the activations move one stage on
(a roll along that dimension: a collective permute). Stage 0 takes the next microbatch; what the last stage
finishes, which the roll brings to stage 0, is kept there per microbatch until its next round starts (M >= S
guarantees it finished before), so that no other traffic happens within an iteration. There are
M * V + S - 1 iterations for M * V stage passes of work on each stage: the bubble is (S - 1) / (M * V + S - 1).
Reverse-mode differentiation of the loop is the backward pass in the reverse order (fill-drain, GPipe-like:
the activations of every iteration are kept, as the remat policy allows). The weights are not: each period
slices its weights from the stage's stack inside a checkpoint that never keeps them (``_period_policy``), so
the backward pass slices them again rather than every iteration keeping a copy of the periods it ran.
Periods that do not split evenly are filled up with identity periods (``pads``, spread over the last stages:
``jaxtron.parallel.stages.identity_slots``): they compute like any other, and their output is replaced by their
input.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtron.common.trace_state import BATCH_OVER_STAGES
from jaxtron.metrics.hlo import once_in
from jaxtron.models.transformer import EMBED_AXES
from jaxtron.parallel.sharding import (
    constrain,
    constrain_in_flight,
    logical_names,
    shard_count,
    stage_axes,
    whole_over_batch,
)
from jaxtron.parallel.stages import identity_slots

SCOPE = "pipeline_schedule"  # the named scope of the schedule's loop
PICKED = "pipeline_period_weights"  # the name of the weights a stage picks for one period

# body(hidden [b, T, D], one period's parameters, extras) -> (hidden, stats of that period)
Body = Callable[[jax.Array, Any, Any], tuple[jax.Array, dict[str, jax.Array]]]


def bubble_fraction(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Share of a stage's time spent idle in the fill-drain schedule, and in the 1F1B one (``one_f_one_b.py``:
    its fill runs forwards only and its drain backwards only, so it idles as long)."""
    return (stages - 1) / (microbatches * virtual_stages + stages - 1)


def split_rows(x: jax.Array, parts: int) -> jax.Array:
    """[B, ...] -> [parts, B / parts, ...]; part j takes rows j, j + parts, ... so no row crosses devices."""
    return jnp.swapaxes(x.reshape(x.shape[0] // parts, parts, *x.shape[1:]), 0, 1)


def join_rows(x: jax.Array) -> jax.Array:
    """The inverse of ``split_rows``."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


@functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
def keep_where(cond: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``jnp.where(cond, a, b)`` for a ``cond`` that broadcasts against the values, under a checkpoint: the backward
    pass recomputes the choice from ``cond`` rather than a loop keeping it, broadcast to the values' shape, for
    every iteration."""
    return jnp.where(cond, a, b)


def _period_policy(policy: Callable | None, stages: int) -> Callable:
    """The checkpoint policy of one period run under the stage vmap: the model's ``policy`` (None: keep
    everything) as it would judge the unbatched program, except that the period's weights, sliced from the
    stage's stack, are never kept (the backward pass slices them again).

    The vmap gives every weight matmul a leading batch dimension of size ``stages``; such a dot is judged as the
    dot it was (``dots_with_no_batch_dims_saveable`` would otherwise keep none). Without a policy, views and
    slices are not kept either (recomputing them costs a copy at most), so that neither the weight slice nor its
    reshape is kept."""
    picked = jax.checkpoint_policies.save_only_these_names(PICKED)
    views = (jax.lax.dynamic_slice_p, jax.lax.gather_p, jax.lax.reshape_p, jax.lax.squeeze_p)  # (vmapped: gather)

    def keep(prim, *args, **params):
        if picked(prim, *args, **params):
            return False
        if policy is None:
            return prim not in views
        if prim is jax.lax.dot_general_p:
            contract, (lhs, rhs) = params["dimension_numbers"]
            if lhs and rhs and args[0].shape[lhs[0]] == stages == args[1].shape[rhs[0]]:
                params = dict(params, dimension_numbers=(contract, (lhs[1:], rhs[1:])))
        return policy(prim, *args, **params)

    return keep


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A runner of the model's layer stack (``Transformer(..., stack_runner=...)``, ``models/stack.py``) on ``stages``
    pipeline stages. Stats come back per period of the model ([periods, ...] in its order, as a plain scan
    gives them), each the mean over the microbatches."""

    stages: int
    microbatches: int
    virtual_stages: int = 1
    remat_policy: Callable | None = None  # the model's checkpoint policy (None: keep everything)
    pads: int = 0  # identity periods in the stored stack (an uneven split, ``parallel/stages.py``)
    # how a training step's gradients are computed: 'fill_drain' differentiates this runner; '1f1b' runs
    # ``one_f_one_b.gradients`` (this runner stays the forward of evaluation)
    kind: str = "fill_drain"
    # ``pipeline.fsdp_gather == 'step'``: the stages' weights gathered over the batch's axes once, before the
    # schedule, and held whole through it (their gradients accumulated whole, reduce-scattered once after it)
    gather_once: bool = False

    def gradients(self, setup, params: Any, batch: dict) -> None:
        """The train step's gradients where the schedule runs its own backward pass (``OneFOneBSchedule``); None
        here: jax differentiates the model through this runner."""
        return

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.stages, self.microbatches, self.virtual_stages)

    def outside(self, rows: int):
        """The context for the work outside the schedule on a batch of ``rows``: its rows split over the stages
        too (``BATCH_OVER_STAGES``), where they divide into the data-parallel size x stages."""
        mesh = jax.sharding.get_abstract_mesh()
        ways = 1 if mesh.empty else shard_count(dict(mesh.shape), "activation_batch") * self.stages
        return BATCH_OVER_STAGES.bound(self.stages > 1 and rows % ways == 0)

    def stage_view(self, stack: Any, lead: tuple[int, ...]) -> Any:
        """The stored stack [periods, ...] as [stages, *lead[1:], ...]: its stage dimension over the pipeline
        axis and the rest as the parameter's own sharding or, with ``gather_once``, the weights whole over the
        batch's axes (gathered here, once). Constrained in full, so that the schedule's gradient accumulator is
        sharded as the parameter (the distributed optimizer's split over the batch's axes, left to propagate into
        the loop, would sum each period's gradient over them in every iteration)."""
        def one(v):
            if not isinstance(v, nnx.Variable):
                return constrain(v.reshape(*lead, *v.shape[1:]), ("stages", ...))
            a = v.get_value().reshape(*lead, *v.get_value().shape[1:])
            names = ("stages", *(None,) * (len(lead) - 1), *logical_names(v)[1:])
            return v.replace(constrain(a, whole_over_batch(names) if self.gather_once else names))
        return jax.tree.map(one, stack, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def __call__(self, body: Body, x: jax.Array, stack: Any, extras: Any) -> tuple[jax.Array, dict]:
        if not BATCH_OVER_STAGES.get():
            return self._run(body, x, stack, extras)
        with BATCH_OVER_STAGES.bound(False):  # the rows come together for the schedule: each stage runs all of them
            x, extras = jax.tree.map(lambda a: constrain(a, ("activation_batch", ...)), (x, extras))
            out, stats = self._run(body, x, stack, extras)
        return constrain(out, ("activation_batch", ...)), stats  # and part again after it

    def _run(self, body: Body, x: jax.Array, stack: Any, extras: Any) -> tuple[jax.Array, dict]:
        s_, v_, m_ = self.stages, self.virtual_stages, self.microbatches
        periods = jax.tree.leaves(stack)[0].shape[0]
        check_schedule(periods, s_, v_, m_)
        per = periods // (s_ * v_)
        identity = identity_slots(periods - self.pads, s_, v_)  # [S, V, P]: the slots of the identity periods
        # [S, V, P, ...]: the stage dimension over the pipeline axis (each stage's block stays where it is stored)
        staged = self.stage_view(stack, (s_, v_, per))
        stage_ids = jnp.arange(s_)

        period = self._periods(body, identity, stage_axes())

        micro_x = split_rows(x, m_)
        micro_extras = jax.tree.map(lambda a: split_rows(a, m_), extras)

        def on_stages(tree):
            """The schedule's activations and queue constrained in full, their rows as the stack's input (left to
            propagation, the queue comes out whole over the batch's axes)."""
            return constrain_in_flight(tree, micro_x.shape[1:], EMBED_AXES)

        first = (stage_ids == 0)  # [S]: stage 0 takes each iteration's entering microbatch

        def on_first(cond, a, b):
            """a on stage 0 where ``cond`` holds, b elsewhere; both [S, ...] (each stage keeps its own)."""
            return keep_where((first & cond).reshape(s_, *(1,) * (a.ndim - 1)), a, b)

        def shift(out, ex):
            """The activations one stage on (a roll along the stage dimension: a collective permute)."""
            return on_stages(jax.tree.map(lambda a: jnp.roll(a, 1, axis=0), (constrain(out, ("stages", ...)), ex)))

        def step(carry, k):
            """Period p of iteration t on every stage (k = t * P + p). An iteration's first period takes the
            entering microbatch on stage 0, its last shifts the activations one stage on. The loop runs over
            periods rather than nesting a loop of periods in a loop of iterations, so that the backward pass adds
            each period's weight gradient in place into the one accumulator of one loop, out of which XLA moves
            the gradients' sum over the batch's axes (once after the schedule, not once an iteration)."""
            # held [S, ...]: the item each stage works on; queue [S, M, ...]: each microbatch's latest activations,
            # of which stage 0's copy is the one read and written (the others stay as they began). Reading and
            # writing it where it lives keeps the schedule's traffic to the one permute of the stage shift
            held, queue = carry
            t, p = k // per, k % per
            pick = lambda a, axis: jax.lax.dynamic_index_in_dim(a, t % m_, axis, False)
            entering = p == 0
            x_in = on_first(entering, pick(queue, 1), held[0])  # stage 0's pick of its queue: the entering microbatch
            extras_in = jax.tree.map(lambda h, e: on_first(entering, jnp.broadcast_to(pick(e, 0), h.shape), h),
                                     held[1], micro_extras)
            held = on_stages((x_in, extras_in))
            rounds = jnp.clip((t - stage_ids) // m_, 0, v_ - 1)  # the round of the item each stage holds
            out, stats = period(held[0], staged, rounds, p, held[1])
            last = p == per - 1
            if per == 1:
                moved = shift(out, held[1])
            else:
                with jax.named_scope(once_in(per)):  # (how often the permute runs, for the HLO's readers)
                    moved = jax.lax.cond(last, shift, lambda o, e: on_stages((constrain(o, ("stages", ...)), e)),
                                         out, held[1])
            # after an iteration's last period, the item the last stage finished (now on stage 0): microbatch
            # done % M of round done // M, written into its slot of the queue (in place, one microbatch's rows)
            done = t - (s_ - 1)
            slot = jax.lax.dynamic_index_in_dim(queue, done % m_, 1, True)
            slot = on_first(last & (done >= 0), moved[0][:, None], slot)
            queue = on_stages(jax.lax.dynamic_update_index_in_dim(queue, slot, done % m_, 1))
            return (moved, queue), stats

        start = jax.tree.map(lambda a: jnp.zeros((s_, *a.shape[1:]), a.dtype), (micro_x, micro_extras))
        queue = on_stages(jnp.broadcast_to(micro_x, (s_, *micro_x.shape)))
        iterations = m_ * v_ + s_ - 1
        with jax.named_scope(SCOPE):  # the loop's HLO ops carry the name (profiles find its iterations by it)
            (_, queue), stats = jax.lax.scan(step, (on_stages(start), queue), jnp.arange(iterations * per))
        # [iterations * P, S, ...] -> [iterations, S, P, ...]
        stats = jax.tree.map(lambda a: jnp.swapaxes(a.reshape(iterations, per, *a.shape[1:]), 1, 2), stats)
        # stage 0's copy, as a sum over the stages of the queue with the others' masked: slicing it would gather
        # every stage's copy onto every device first
        current = jnp.sum(jnp.where(first.reshape(s_, *(1,) * (queue.ndim - 1)), queue, 0), axis=0)
        return join_rows(current), self._in_model_order(stats, identity, per)

    def _in_model_order(self, stats: dict, identity: np.ndarray, per: int) -> dict:
        """Stats [iterations, S, P, ...] -> [periods, ...]: microbatch m's pass of round r over stage s happened in
        iteration r * M + m + s; stacked [M, V, S, P] its periods are in the order they ran ((r * S + s) * P + p),
        of which the identity ones are left out. Each the mean over the microbatches."""
        s_, v_, m_ = self.stages, self.virtual_stages, self.microbatches
        m, r, s = np.meshgrid(np.arange(m_), np.arange(v_), np.arange(s_), indexing="ij")
        real = np.nonzero(~identity.transpose(1, 0, 2).reshape(-1))[0]
        return jax.tree.map(lambda a: jnp.mean(a[r * m_ + m + s, s].astype(jnp.float32), axis=0)
                            .reshape(v_ * s_ * per, *a.shape[3:])[real], stats)

    def _periods(self, body: Body, identity: np.ndarray, spmd) -> Callable:
        """``period(h, stack, rounds, p, ex)``: period p of every stage, checkpointed under the model's policy
        (``_period_policy``)."""
        s_, v_ = self.stages, self.virtual_stages
        stage_ids = jnp.arange(s_)

        def stage_period(h, weights, s, r, p, ex):
            """Period p of round r on stage s, its weights [V, ...] (period p of each round); an identity period
            leaves h as it is (its stats are dropped)."""
            pick = lambda a: a[0] if v_ == 1 else jax.lax.dynamic_index_in_dim(a, r, 0, False)
            out, stats = body(h, checkpoint_name(jax.tree.map(pick, weights), PICKED), ex)
            if not self.pads:
                return out, stats
            return keep_where(jnp.asarray(identity)[s, r, p], h, out), stats

        def period(h, stack, rounds, p, ex):
            """Period p of every stage: its weights [S, V, ...] sliced from the whole [S, V, P, ...] stack at an
            index every device shares, inside the checkpoint and named so that no policy keeps them (the backward
            pass slices them again instead of every iteration keeping a copy of the periods it ran). The backward
            pass adds each period's gradient in place at that index; with one round no index is batched over the
            stages, so XLA sums the weights' gradients over the batch's axes once after the schedule rather than in
            each iteration."""
            weights = jax.tree.map(lambda a: checkpoint_name(jax.lax.dynamic_index_in_dim(a, p, 2, False), PICKED),
                                   stack)
            return jax.vmap(stage_period, in_axes=(0, 0, 0, 0, None, 0), spmd_axis_name=spmd)(
                h, weights, stage_ids, rounds, p, ex)

        return jax.checkpoint(period, policy=_period_policy(self.remat_policy, s_), prevent_cse=False)


def check_schedule(periods: int, stages: int, virtual_stages: int, microbatches: int) -> None:
    """ValueError naming what the schedule cannot do with these sizes (configs are checked earlier, in
    ``jaxtron.parallel.checks.check_devices``; this guards direct callers)."""
    if periods % (stages * virtual_stages):
        raise ValueError(f"{periods} periods do not split into {stages} stages x {virtual_stages} virtual stages")
    if microbatches < stages:
        raise ValueError(f"{microbatches} microbatches cannot keep {stages} stages busy; use at least {stages}")

