"""The 1F1B pipeline schedules (``pipeline.schedule='1f1b'`` and ``'interleaved'``): the microbatches' forward and
backward passes interleaved in one SPMD program, the loss computed inside the schedule.

With S stages and M microbatches, iteration t runs on every stage s (one program, vmapped over the stage
dimension that the rules table shards over the pipeline axis, as ``pipeline.py``'s fill-drain does):

- the forward of microbatch t - s: stage 0 embeds microbatch t (and runs the dense prefix), the others take what
  stage s - 1 sent; the stage keeps each of its periods' inputs, nothing else;
- the head and the loss of the microbatch the last stage just finished, with their gradient, each stage on
  every S-th of its tokens (``head_pieces``);
- the backward of microbatch t - 2(S - 1) + s, period by period from the last: the period's forward recomputed
  from the input it kept and its vector-Jacobian product taken at once, with the gradient stage s + 1 sent (the
  last stage: the loss's). The blocks run without their checkpoints here (``models/stack.without_remat``): each
  forward runs twice in all, as under ``remat=full``, whatever ``execution.remat`` says. The parameters' gradients
  are summed as they come, and stage 0 passes its input gradient back through the embedding.

Then the activations move one stage on and the gradients one stage back (two collective permutes). A stage keeps
its periods' inputs for the microbatches between their forward and their backward, at most 2S - 1 (stage 0),
whatever M is; fill-drain keeps every microbatch's. The schedule runs M + 2(S - 1) iterations: the first S - 1
run the forward phase only and the last S - 1 the backward phase only (a condition on the iteration, the same on
every device), so a stage idles (S - 1) forwards and (S - 1) backwards of the M of each it runs: the share
(S - 1) / (M + S - 1), as in fill-drain.

The interleaved schedule (``pipeline.schedule='interleaved'``) runs the same loop over V chunks of layers a stage
(chunk v S + s on stage s, the stage-major stack's order), the timetable of ``parallel/timetable.py``: M V + V S
+ S - 2 iterations of a chunk's forward and backward, idle share (S - 1) / (M V + S - 1), at most 2 V S - 1
chunks' inputs kept. With V = 1 it is the 1F1B schedule above.

The objective is the fill-drain schedule's: the cross-entropy (and z-loss) sums of the microbatches, and the MoE
auxiliary losses as the token count times their mean over blocks and microbatches, so both schedules compute the
same gradients. The model is the one the training step runs: its forward up to the layer stack (``pre``) and from
it (``post``) are the train step's own loss with a stack runner that hands the stack's input out (``Capture``) or
takes its output in (``Replace``), both in ``stack_cut.py``; the stack's periods run as ``body`` under the model's
remat policy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtron.metrics.hlo import taken
from jaxtron.models.transformer import EMBED_AXES
from jaxtron.parallel import timetable
from jaxtron.parallel.sharding import constrain, constrain_in_flight, replica_map, stage_axes
from jaxtron.parallel.stages import PAD, identity_slots, storage_order
from jaxtron.parallel.state_sharding import optimizer_spec
from jaxtron.training.loss import moe_metrics
from jaxtron.training.pipeline.fill_drain import SCOPE, Schedule, check_schedule
from jaxtron.training.pipeline.head_pieces import at_stage, head_pieces, to_last, to_stages, token_pieces
from jaxtron.training.pipeline.loop_carry import Carry, Forward, zeros_of
from jaxtron.training.pipeline.replicas import ScheduleReplicas, when
from jaxtron.training.pipeline.stack_cut import Batch, CutModel

FORWARD_PHASE = "one_f_one_b_forward"  # the named scopes of an iteration's two phases
BACKWARD_PHASE = "one_f_one_b_backward"


@dataclasses.dataclass(frozen=True)
class OneFOneBSchedule(Schedule):
    """The 1F1B and interleaved schedules as the layer stack's runner: the forward pass (evaluation) runs as
    fill-drain's, and the train step's gradients are this module's (``gradients``)."""

    def gradients(self, setup, params: Any, batch: Batch) -> tuple[Any, jax.Array, jax.Array, dict]:
        """(summed gradients, cross-entropy sum, token count, MoE metrics) of the batch under this schedule; the
        same numbers as ``step.gradients`` with the fill-drain schedule."""
        return OneFOneB(setup, params, batch).gradients()


class OneFOneB:
    """The schedule of one step, its named steps: ``stage_forward`` and ``stage_backward`` (a stage's chunk, period
    by period), ``forward_phase`` and ``backward_phase`` (every stage's, with the head, the loss and the
    embedding's backward), ``iteration`` (both phases, the stash and the hand-overs), ``gradients`` (the loop and
    the sums it leaves)."""

    def __init__(self, setup, params: Any, batch: Batch):
        schedule = self.schedule = setup.stack_runner
        self.setup, self.params = setup, params
        self.s_, self.m_ = schedule.stages, schedule.microbatches
        self.v_ = schedule.virtual_stages if schedule.kind == "interleaved" else 1
        self.model = model = CutModel(setup, params, batch)
        self.first = model.pick(0)
        # the periods' float32 gradient sums back to the parameters: the working copy's periods are in the compute
        # dtype (``training/working_copy.py``), and a vjp of theirs would round the sums to it
        _, self.to_params = jax.vjp(self._stack_of, jax.tree.map(
            lambda a: a.astype(jnp.promote_types(a.dtype, jnp.float32)), params))
        self.periods_0 = self._stack_of(params)
        self.stack_size = jax.tree.leaves(self.periods_0)[0].shape[0]
        self._check()
        self.per = self.stack_size // self.s_  # periods of a stage: its chunks' pc each, chunk v's at v * pc
        self.pc = self.per // self.v_
        self.identity = jnp.asarray(identity_slots(self.stack_size - schedule.pads, self.s_, self.v_)
                                    .reshape(self.s_, self.per))  # [S, P]
        self.staged = schedule.stage_view(self.periods_0, (self.s_, self.per))
        self.stack_def = jax.tree.structure(self.staged)
        self.stage_ids = jnp.arange(self.s_)
        self.stats_shape = jax.eval_shape(lambda: self.stage_forward(
            jax.tree.map(lambda a: a[0], self.staged), *zeros_of((self.x_shape, self.ex_shape), ()), 0, 0))[1]
        # an MoE model's prediction modules have MoE blocks too
        model.weigh_blocks(self.stack_size - schedule.pads + (model.depth if self.stats_shape else 0))
        mesh = jax.sharding.get_abstract_mesh()
        self.spmd = stage_axes()
        self.rows = ScheduleReplicas(params, self.periods_0, schedule, mesh, bool(self.stats_shape))
        self.keep = timetable.kept(self.s_, self.v_)  # units whose inputs a stage holds from forward to backward
        self.head_pieces = head_pieces(self.s_, self.x_shape.shape[1], model.depth)

    def _stack_of(self, p):
        """The stack's periods of the parameters ``p``; notes the body and the stack input's shapes."""
        x, ex, stack, self.body = self.model.pre(p, self.first)
        self.x_shape, self.ex_shape = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (x, ex))
        return stack

    def _check(self) -> None:
        check_schedule(self.stack_size, self.s_, self.v_, self.m_)
        if self.m_ % self.s_ and self.v_ > 1:
            raise ValueError(f"{self.m_} microbatches do not form waves of {self.s_} (one per stage), which the "
                             "interleaved schedule runs through each virtual stage in turn")

    def unit(self, k, backward=False):
        """(whether it is one, its microbatch, its chunk) of a stage's k-th unit (``parallel/timetable.py``)."""
        return timetable.unit(k, self.s_, self.m_, self.v_, backward)

    def on_stages(self, tree):
        """Hidden states [S, ..., b, T, D] and extras [S, ..., b, T] constrained in full (left to propagation,
        the zeros that start the stash and the buffers come out whole on every device, and so do the
        recomputations that read them)."""
        return constrain_in_flight(tree, self.x_shape.shape, EMBED_AXES)

    def period(self, w, h, ex, s, p):
        out, stats = self.body(h, w, ex)
        return jnp.where(self.identity[s, p], h, out), stats

    def slot(self, v, p):
        """Where period ``p`` of chunk ``v`` sits in a stage's stack. With one chunk a stage, the same index on
        every stage, so XLA slices and adds in place (GPT-3 175B's layout as 1F1B: 67.77 -> 65.29 s of budget); a
        chunk index per stage makes a gather and a scatter that read the slice apart (12 bytes an element more)."""
        return p if self.v_ == 1 else v * self.pc + p

    @property
    def iterations(self) -> int:
        return timetable.iterations(self.s_, self.m_, self.v_)

    @property
    def backward_share(self) -> str:
        """``hlo.taken`` of the backward phase: it runs from iteration V S - 1 on, the fill's none."""
        return taken(self.iterations - timetable.first_backward(self.s_, self.v_), self.iterations)

    @staticmethod
    def weights_of(stack_s, p):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, p, 0, False), stack_s)

    def stage_forward(self, stack_s, h, ex, s, v):
        """-> (the stage's output, each period's stats [pc, ...], each period's input [pc, ...]) of its chunk
        ``v``."""
        def one(h, p):
            at = self.slot(v, p)
            out, stats = self.period(self.weights_of(stack_s, at), h, ex, s, at)
            return out, (stats, h)
        out, (stats, inputs) = jax.lax.scan(one, h, jnp.arange(self.pc))
        return out, stats, inputs

    def stats_cotangent(self, s, p, valid):
        """The MoE losses' gradient for each block's stats of a microbatch (``CutModel.weigh_blocks``); identity
        periods get none."""
        scale = jnp.where(self.identity[s, p], 0.0, self.model.scale_blocks) * valid.astype(jnp.float32)
        return {k: jnp.full(v.shape[1:], scale * self.model.coefficient.get(k, 0.0), v.dtype)
                for k, v in self.stats_shape.items()}

    def stage_backward(self, active, stack_s, acc, inputs, ex, s, v, dy, valid):
        """The stage's backward of its chunk ``v`` where ``active`` (the same on every device: the fill's
        iterations run none), period by period from the last: each period's forward recomputed from its kept input
        (``inputs`` [pc, ...]) and its vector-Jacobian product taken at once, its weight gradients added into the
        stage's accumulator ``acc`` [P, ...] in place (no stage-sized gradient of one microbatch is ever whole).
        -> (the accumulator, the input gradient)."""
        pc = self.pc

        def vjp(dy, p):
            at = self.slot(v, p)
            _, pullback = jax.vjp(lambda w, x: self.period(w, x, ex, s, at), self.weights_of(stack_s, at),
                                  jax.lax.dynamic_index_in_dim(inputs, p, 0, False))
            dw, dx = pullback((dy, self.stats_cotangent(s, at, valid)))
            leaves = self.rows.as_weights(jax.tree.leaves(dw), self.rows.stack_names)
            return jax.tree.unflatten(jax.tree.structure(dw), leaves), dx

        def one(carry, p):
            dy, acc = carry
            with jax.named_scope(self.backward_share):  # the budget counts the iterations that run it
                dw, dx = when(active, vjp, dy, p)
            at = self.slot(v, p)
            acc = jax.tree.map(lambda a, d: a.at[at].add(d.astype(a.dtype), mode="promise_in_bounds"), acc, dw)
            return (dx, acc), None
        (dx, acc), _ = jax.lax.scan(one, (dy * valid.astype(dy.dtype), acc), jnp.arange(pc), reverse=True)
        return acc, dx

    def stage_backward_per_replica(self, active, stack_s, acc, inputs, ex, s, v, dy, valid):
        """``stage_backward`` on each replica's rows apart, each into its own accumulator (``acc`` [R, P, ...])."""
        acc, dx = self.rows.map(self.stage_backward, (None, None, "per_replica", 1, 0, None, None, 0, None), active,
                                stack_s, acc, inputs, ex, s, v, dy, valid)
        return acc, dx.reshape(dy.shape)

    def head(self, h, mb, valid_h):
        """The head's and the loss's gradients of microbatch ``mb`` from the stack's output ``h``, scaled by
        ``valid_h``: (the rest's, ``h``'s, the cross-entropy sum, the token count, the modules' sums)."""
        rows = self.rows
        _, pullback, (ce, n, mtp_ce, mtp_stats) = jax.vjp(
            lambda r, h: self.model.post(rows.with_rest(r), h, mb), rows.rest_leaves, h, has_aux=True)
        d_rest, d_h = pullback(valid_h)
        mtp = jax.tree.map(lambda a: valid_h * a.astype(jnp.float32), (mtp_ce, mtp_stats))
        return rows.rest_of(d_rest), d_h.astype(self.x_shape.dtype), valid_h * ce, valid_h * n, mtp

    def forward_phase(self, t, moving) -> Forward:
        """Every stage's forward, and the head and loss of the microbatch the last stage finished (with their
        gradients: ``d_h`` for the stack's output, the rest's for the parameters outside the stack)."""
        s_, v_ = self.s_, self.v_
        # stage s runs its forward unit t - s: stage 0 embeds a microbatch for chunk 0, or takes what stage S - 1
        # handed on for a later chunk
        _, m_in, v_in = self.unit(timetable.forward_unit(t, 0))
        mb = self.model.pick(m_in)

        def stage_input(x_s, ex_s, s):
            # every stage embeds the microbatch on its own devices and stage 0 keeps it: computed once for all
            # stages, XLA split the lookup over them and summed the result over the pipeline (75 MB an iteration,
            # GPT-3 175B's published layout)
            x0, ex0, _, _ = self.model.pre(self.params, mb)
            fresh = (v_in == 0) & (s == 0)
            return jnp.where(fresh, x0, x_s), jax.tree.map(lambda a, b: jnp.where(fresh, b, a), ex_s, ex0)

        inputs = self.on_stages(jax.vmap(stage_input, spmd_axis_name=self.spmd)(*moving, self.stage_ids))
        _, _, chunks = self.unit(timetable.forward_unit(t, self.stage_ids))
        forward_all = jax.vmap(self.stage_forward, spmd_axis_name=self.spmd)
        out, stats, period_inputs = forward_all(self.staged, inputs[0], inputs[1], self.stage_ids, chunks)
        last_valid, m_head, last_chunk = self.unit(timetable.forward_unit(t, s_ - 1))
        valid_h = (last_valid & (last_chunk == v_ - 1)).astype(jnp.float32)
        # every iteration, masked where the last stage finished no microbatch (interleaved: V - 1 of V): behind a
        # condition, GPT-3 175B's step held 12 GiB more per device (compiled for H100s, 32 layers on
        # pipeline=8 data=4 tensor=4), for a head of 0.4% of its FLOPs
        spread = self.head_pieces > 1  # the head's input: each stage's piece of the tokens, else the whole
        d_post, d_h, ce, n, mtp = self.rows.map(lambda h, mb: self.spread_head(h, mb, valid_h), (int(spread), 0),
                                                to_stages(out) if spread else out[s_ - 1], self.model.pick(m_head))
        if spread:  # [R, S, ...] -> [S, b, T / S, D] -> joined on the last stage
            d_h = to_last(jnp.moveaxis(d_h, 0, 1).reshape(s_, -1, *d_h.shape[3:]))
        else:  # the same on every stage
            d_h = jnp.broadcast_to(d_h.reshape(self.x_shape.shape), (s_, *self.x_shape.shape))
        d_post = [jnp.moveaxis(g, 1, 0) for g in d_post]  # [S, R, ...], as the accumulators
        return Forward(out, inputs[1], stats, self.on_stages(period_inputs), d_post, d_h, jnp.sum(ce), jnp.sum(n),
                       jax.tree.map(lambda a: jnp.sum(a, axis=0), mtp))

    def spread_head(self, h, mb, valid_h):
        """``head`` of one replica's rows. With the tokens split over the stages (``head_pieces``), ``h`` [S, b, T / S,
        D] holds each stage's piece (``head_pieces.to_stages``) and each stage runs the head and the loss of its own;
        else ``h`` [b, T, D] is the whole, which every stage runs. -> ``head``'s results, the rest's gradients per stage
        [S, ...] and ``h``'s gradient in ``h``'s shape."""
        if self.head_pieces == 1:  # on every stage (the gradient sum at S - 1, the zeros elsewhere the others')
            d_rest, d_h, ce, n, mtp = self.head(h, mb, valid_h)
            return at_stage(d_rest, self.s_ - 1, self.s_), d_h, ce, n, mtp
        pieces = replica_map(lambda h, mb: self.head(h, mb, valid_h), self.spmd)(
            h, jax.tree.map(lambda a: token_pieces(a, self.head_pieces), mb))
        d_rest, d_h, ce, n, mtp = pieces
        return d_rest, d_h, jnp.sum(ce), jnp.sum(n), jax.tree.map(lambda a: jnp.sum(a, axis=0), mtp)

    def backward_phase(self, t, back, d_h, stash, grad_stack):
        """Every stage's backward (the last stage's gradient from the loss, ``d_h``) into its accumulator, and stage
        0's input gradient back through the embedding (and the dense prefix); -> (the gradients moving back, the
        accumulators, the rest's gradients)."""
        s_, v_, rows = self.s_, self.v_, self.rows
        # stage s runs its backward unit t - (VS - 1) - (S - 1 - s): the last stage's chunk V - 1 of the
        # microbatch whose loss this iteration computed, or what stage 0 handed back from a later chunk
        active = t >= timetable.first_backward(s_, v_)
        j = timetable.backward_unit(t, self.stage_ids, s_, v_)
        valid_b, _, chunks = self.unit(j, backward=True)
        slot_b = timetable.forward_unit_of_backward(j, s_, v_) % self.keep  # where its chunk's inputs are
        saved = self.on_stages(jax.vmap(lambda st, i: jax.tree.map(
            lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), st))(stash, slot_b))
        last = (self.stage_ids == s_ - 1) & (chunks == v_ - 1)  # the last stage's gradient from the loss
        dy = self.on_stages(jnp.where(last.reshape(-1, *(1,) * (back.ndim - 1)), d_h, back))
        backward_all = jax.vmap(self.stage_backward_per_replica, in_axes=(None, 0, 0, 0, 0, 0, 0, 0, 0),
                                spmd_axis_name=self.spmd)
        grad_stack, dx = backward_all(active, self.staged, jax.tree.unflatten(self.stack_def, grad_stack), saved[0],
                                      saved[1], self.stage_ids, chunks, dy, valid_b)
        grad_stack = rows.stack_sharded(jax.tree.leaves(grad_stack))
        first_valid, m_first, first_chunk = self.unit(timetable.backward_unit(t, 0, s_, v_), backward=True)
        valid_0 = first_valid & (first_chunk == 0)  # (only in an iteration that runs the backward phase)

        def embedding_backward(dx0, mb):
            _, pre_pullback = jax.vjp(lambda r: self.model.pre(rows.with_rest(r), mb)[0], rows.rest_leaves)
            return rows.rest_of(pre_pullback(dx0)[0])

        def stage_embedding_backward(dx_s, s, mb):
            # on every stage, stage 0's input gradient and zeros elsewhere: the stage dimension stays on its
            # devices. Computed once for all stages, XLA split the scatter over them and summed a float32 vocabulary
            # shard over the pipeline every iteration (618 MB a microbatch, GPT-3 175B's published layout)
            keep = (valid_0 & (s == 0)).astype(dx_s.dtype)
            return rows.map(embedding_backward, (0, 0), dx_s * keep, mb)

        with jax.named_scope(taken(self.m_, self.iterations)):  # once a microbatch
            d_pre = when(valid_0, lambda dx, mb: jax.vmap(stage_embedding_backward, in_axes=(0, 0, None),
                                                          spmd_axis_name=self.spmd)(dx, self.stage_ids, mb),
                         dx, self.model.pick(m_first))
        return self.on_stages(jnp.roll(self.on_stages(dx), -1, axis=0)), grad_stack, d_pre

    def iteration(self, carry: Carry, t) -> tuple[Carry, None]:
        """The forward phase while microbatches enter (t < M + S - 1), the backward phase once the first one
        reached the loss (t >= S - 1): the same branch on every device, so the fill carries no backward and the
        drain no forward."""
        runs = timetable.forward_iterations(self.s_, self.m_, self.v_)
        with jax.named_scope(FORWARD_PHASE), jax.named_scope(taken(runs, self.iterations)):
            # the trace times the phases by these names (metrics/bubble.py); the budget counts the forward's runs
            f = when(t < runs, self.forward_phase, t, carry.moving)
        valid_f, _, chunks = self.unit(timetable.forward_unit(t, self.stage_ids))
        slot_f = timetable.forward_unit(t, self.stage_ids) % self.keep
        stash = self.on_stages(jax.vmap(lambda st, x, i, v: jax.tree.map(
            lambda a, b: jnp.where(v, jax.lax.dynamic_update_index_in_dim(a, b, i, 0), a), st, x))(
            carry.stash, (f.period_inputs, f.extras), slot_f, valid_f))
        pc = self.pc
        stats_sum = jax.tree.map(lambda acc, a: jax.vmap(
            lambda acc_s, a_s, v, ok: jax.lax.dynamic_update_slice_in_dim(
                acc_s, jax.lax.dynamic_slice_in_dim(acc_s, v * pc, pc, 0) + jnp.where(ok, a_s.astype(jnp.float32), 0.0),
                v * pc, 0))(acc, a, chunks, valid_f), carry.stats_sum, f.stats)
        moving = self.on_stages(jax.tree.map(lambda a: jnp.roll(a, 1, axis=0), (f.out, f.extras)))
        with jax.named_scope(BACKWARD_PHASE):
            back, grad_stack, d_pre = self.backward_phase(t, carry.back, f.d_h, stash, carry.grad_stack)
        grad_rest = self.rows.add_rest(self.rows.add_rest(carry.grad_rest, f.d_post), d_pre)
        sums = (carry.sums[0] + f.ce, carry.sums[1] + f.n)
        return Carry(moving, back, stash, grad_stack, grad_rest, sums, stats_sum,
                     jax.tree.map(jnp.add, carry.mtp_sum, f.mtp)), None

    def start(self) -> Carry:
        """The loop's first carry: zeros, the accumulators float32 and sharded as their parameters (left
        unconstrained, XLA keeps them whole on every device)."""
        s_, r_, rows = self.s_, self.rows.count, self.rows
        x_shape, ex_shape = self.x_shape, self.ex_shape
        # the prediction modules' cross-entropy sums and routing stats, summed over the microbatches
        mtp_zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32),
                                 jax.eval_shape(lambda h: self.model.post(self.params, h, self.first)[1][2:], x_shape))
        return Carry(
            moving=self.on_stages((zeros_of(x_shape, (s_,)), zeros_of(ex_shape, (s_,)))),
            back=self.on_stages(zeros_of(x_shape, (s_,))),
            stash=self.on_stages((zeros_of(x_shape, (s_, self.keep, self.pc)), zeros_of(ex_shape, (s_, self.keep)))),
            grad_stack=rows.stack_sharded([jnp.zeros((s_, r_, *a.shape[1:]), jnp.float32)
                                           for a in jax.tree.leaves(self.staged)]),
            grad_rest=rows.rest_sharded([jnp.zeros((s_, r_) if staged else (s_, r_, *a.shape), jnp.float32)
                                         for a, staged in zip(rows.param_leaves, rows.in_stack, strict=True)]),
            sums=(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)),
            stats_sum=jax.tree.map(lambda a: jnp.zeros((s_, self.v_ * a.shape[0], *a.shape[1:]), jnp.float32),
                                   self.stats_shape),
            mtp_sum=mtp_zeros)

    def gradients(self) -> tuple[Any, jax.Array, jax.Array, dict]:
        """The loop, then the replicas' sums and the gradients in the parameters' layout (``OneFOneBSchedule``)."""
        with jax.named_scope(SCOPE):  # the loop's HLO ops carry the name (profiles find its iterations by it)
            end, _ = jax.lax.scan(self.iteration, self.start(), jnp.arange(self.iterations))
        grads = self._parameter_gradients(end.grad_stack, end.grad_rest)
        metrics = moe_metrics(self._block_stats(end.stats_sum, end.mtp_sum[1]))
        if self.model.depth:  # the modules' loss as the fill-drain step reports it: the mean over depths of each
            metrics["mtp_loss"] = jnp.mean(end.mtp_sum[0] / jnp.maximum(self.model.valid_k, 1.0))
        return grads, end.sums[0], end.sums[1], metrics

    def _parameter_gradients(self, grad_stack, grad_rest):
        """The replicas' sums, reduce-scattered onto the distributed optimizer's shards where it runs, in the
        parameters' layout, float32 (the step casts them to the masters' dtypes)."""
        rows = self.rows
        grad_stack = jax.tree.unflatten(self.stack_def, [
            self._summed_layout(jnp.sum(g, axis=1), ("stages", "layers", *names))
            for g, names in zip(grad_stack, rows.stack_names, strict=True)])
        (d_from_stack,) = self.to_params(jax.tree.map(lambda g, a: g.reshape(a.shape), grad_stack, self.periods_0))
        return jax.tree.unflatten(rows.params_def, [
            a + (0.0 if staged else jnp.sum(b, axis=(0, 1)))
            for a, b, staged in zip(jax.tree.leaves(d_from_stack), grad_rest, rows.in_stack, strict=True)])

    def _summed_layout(self, grad, names):
        """A staged weight's gradient summed over the replicas, held in its parameter's layout or the distributed
        optimizer's."""
        if self.setup.distributed_optimizer:
            return constrain(grad, optimizer_spec(names, grad.shape, dict(jax.sharding.get_abstract_mesh().shape)))
        return constrain(grad, names)

    def _block_stats(self, stats_sum, mtp_stats):
        """Each block's routing stats, the mean over the microbatches, in the model's order (the prediction
        modules' after the stack's)."""
        s_, m_ = self.s_, self.m_
        order = storage_order(self.stack_size - self.schedule.pads, s_, self.v_)  # the period at each stored slot
        real = np.nonzero(order != PAD)[0]
        natural = real[np.argsort(order[real])]  # the stored slot of each of the model's periods, in its order
        stack = jax.tree.map(lambda a: (a / m_).reshape(s_ * self.per, *a.shape[2:])[natural], stats_sum)
        if mtp_stats:
            return jax.tree.map(lambda a, b: jnp.concatenate([a, b / m_]), stack, mtp_stats)
        return stack
