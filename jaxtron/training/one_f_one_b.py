"""The 1F1B pipeline schedules (``pipeline.schedule='1f1b'`` and ``'interleaved'``): the microbatches' forward and
backward passes interleaved in one SPMD program, the loss computed inside the schedule.

With S stages and M microbatches, iteration t runs on every stage s (one program, vmapped over the stage
dimension that the rules table shards over the pipeline axis, as ``pipeline.py``'s fill-drain does):

- the forward of microbatch t - s: stage 0 embeds microbatch t (and runs the dense prefix), the others take what
  stage s - 1 sent; the stage keeps each of its periods' inputs, nothing else;
- on the last stage, the head and the loss of the microbatch it just finished, with their gradient;
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

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.models.stack import without_remat
from jaxtron.models.transformer import EMBED_AXES, mtp_valid
from jaxtron.parallel import timetable
from jaxtron.parallel.sharding import (
    BATCH_AXES,
    constrain,
    constrain_groups,
    constrain_on_stages,
    constrain_stage_groups,
    group_map,
    logical_names,
    logical_to_spec,
    row_groups,
    spec_axes,
)
from jaxtron.parallel.stages import PAD, identity_slots, storage_order
from jaxtron.parallel.state_sharding import constrain_gathered_gradients, constrain_gradient
from jaxtron.training.pipeline import SCOPE, check_schedule, split_rows
from jaxtron.training.stack_cut import Capture, Replace

FORWARD_PHASE = "one_f_one_b_forward"  # the named scopes of an iteration's two phases
BACKWARD_PHASE = "one_f_one_b_backward"

Batch = dict[str, jax.Array]


_ACTIVE: list[Any] = [True]  # whether the backward phase of this iteration runs (see ``_active``)


@contextlib.contextmanager
def _active(active: jax.Array):
    """While tracing the stages' backward: ``active`` says whether the iteration runs it (a scalar, the same on
    every device, so the per-period branch stays a branch under the stages' vmap)."""
    _ACTIVE.append(active)
    try:
        yield
    finally:
        _ACTIVE.pop()


def gradients(setup, params: Any, batch: Batch, loss_sums: Callable, moe_metrics: Callable
              ) -> tuple[Any, jax.Array, jax.Array, dict]:
    """(summed gradients, cross-entropy sum, token count, MoE metrics) of the batch under the 1F1B schedule of
    ``setup.stack_runner``; the same numbers as ``step.gradients`` with the fill-drain schedule. ``loss_sums`` and
    ``moe_metrics``: the train step's (``training/step.py``)."""
    schedule = setup.stack_runner
    s_, m_ = schedule.stages, schedule.microbatches
    v_ = schedule.virtual_stages if schedule.kind == "interleaved" else 1
    micro = jax.tree.map(lambda a: split_rows(a, m_), batch)  # [M, b, ...]
    weights = batch.get("loss_mask")
    weights = jnp.ones(batch["targets"].shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    count = jnp.sum(weights)
    common = dict(graphdef=setup.graphdef, logit_chunks=setup.logit_chunks)
    # the prediction modules run with the head, a microbatch at a time: each depth's cross-entropy sum enters the
    # objective with the weight the whole batch gives it (the token count x mtp_loss over the depths and over the
    # positions the depth scores in the whole batch), so the microbatches add up to the fill-drain objective
    depth = jax.tree.leaves(params["mtp"])[0].shape[0] if "mtp" in params else 0
    valid_k = jnp.stack([jnp.sum(mtp_valid(weights, batch.get("segment_ids"), k)) for k in range(1, depth + 1)]) \
        if depth else jnp.zeros((0,), jnp.float32)
    mtp_weights = count * setup.mtp_loss / (max(depth, 1) * jnp.maximum(valid_k, 1.0))

    def pick(t):
        return {k: constrain(jax.lax.dynamic_index_in_dim(v, jnp.clip(t, 0, m_ - 1), 0, False), BATCH_AXES)
                for k, v in micro.items()}

    def pre(p, mb):
        """-> (the stack's input, its extras, its periods, body) of microbatch ``mb``; the body's blocks without
        checkpoints (each period's backward runs right after its forward is recomputed)."""
        capture = Capture()
        with without_remat():
            loss_sums(p, batch=mb, z_loss=0.0, stack_runner=capture, **common)
        if capture.seen is None:
            raise ValueError("the model has no stacked blocks for the 1f1b schedule to run")
        body, x, stack, extras = capture.seen
        return x, extras, stack, body

    def post(p, h, mb):
        """-> (the objective's sums of the head, the loss and the prediction modules, (cross-entropy sum, token
        count, the modules' cross-entropy sums [depth], their blocks' routing stats [depth, ...])) of ``h``, the
        stack's output."""
        objective, (ce, n, extra) = loss_sums(p, batch=mb, z_loss=setup.z_loss, stack_runner=Replace(h),
                                              mtp_loss=setup.mtp_loss if depth else None, mtp_weights=mtp_weights,
                                              **common)
        mtp_stats = extra.get("mtp_stats", {})
        # their MoE losses, weighted as the stack's blocks' are (``stats_cotangent``)
        objective += sum(scale_blocks * coefficient.get(k, 0.0) * jnp.sum(v) for k, v in mtp_stats.items())
        return objective, (ce, n, extra.get("mtp_sums", jnp.zeros((0,), jnp.float32)), mtp_stats)

    first = pick(0)
    seen = {}  # what tracing the model once tells: the body and the stack input's shapes

    def stack_of(p):
        x, ex, stack, seen["body"] = pre(p, first)
        seen["shapes"] = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (x, ex))
        return stack

    periods_0, to_params = jax.vjp(stack_of, params)  # the stack's periods, and back to the parameters
    body, (x_shape, ex_shape) = seen["body"], seen["shapes"]
    stack_size = jax.tree.leaves(periods_0)[0].shape[0]
    check_schedule(stack_size, s_, v_, m_)
    if m_ % s_ and v_ > 1:
        raise ValueError(f"{m_} microbatches do not form groups of {s_} (one per stage), which the interleaved "
                         "schedule runs through each virtual stage in turn")
    per = stack_size // s_  # periods of a stage: its virtual stages' (chunks') pc each, chunk v's at v * pc
    pc = per // v_
    layout = identity_slots(stack_size - schedule.pads, s_, v_)
    identity = jnp.asarray(layout.reshape(s_, per))  # [S, P]
    staged = schedule.stage_view(periods_0, (s_, per))
    stage_ids = jnp.arange(s_)
    zeros = lambda shape, lead: jax.tree.map(lambda a: jnp.zeros((*lead, *a.shape), a.dtype), shape)

    def period(w, h, ex, s, p):
        out, stats = body(h, w, ex)
        return jnp.where(identity[s, p], h, out), stats

    def weights_of(stack_s, p):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, p, 0, False), stack_s)

    def unit(k, backward=False):
        """(whether it is one, its microbatch, its chunk) of a stage's k-th unit (``parallel/timetable.py``)."""
        return timetable.unit(k, s_, m_, v_, backward)

    def stage_forward(stack_s, h, ex, s, v):
        """-> (the stage's output, each period's stats [pc, ...], each period's input [pc, ...]) of its chunk ``v``."""
        def one(h, p):
            out, stats = period(weights_of(stack_s, v * pc + p), h, ex, s, v * pc + p)
            return out, (stats, h)
        out, (stats, inputs) = jax.lax.scan(one, h, jnp.arange(pc))
        return out, stats, inputs

    # the MoE losses' gradient: the token count times the coefficient over (MoE blocks x microbatches), for each
    # block's stats of each microbatch; identity periods get none
    stats_shape = jax.eval_shape(lambda: stage_forward(jax.tree.map(lambda a: a[0], staged),
                                                       *zeros((x_shape, ex_shape), ()), 0, 0))[1]
    blocks = stack_size - schedule.pads + (depth if stats_shape else 0)  # an MoE model's modules have MoE blocks
    coefficient = {"aux_loss": setup.router_aux_loss, "z_loss": setup.router_z_loss}
    scale_blocks = count / (blocks * m_)

    def stats_cotangent(s, p, valid):
        scale = jnp.where(identity[s, p], 0.0, scale_blocks) * valid.astype(jnp.float32)
        return {k: jnp.full(v.shape[1:], scale * coefficient.get(k, 0.0), v.dtype) for k, v in stats_shape.items()}

    mesh = jax.sharding.get_abstract_mesh()
    spmd = None if mesh.empty else spec_axes(logical_to_spec(("stages",)), 0) or None
    forward_all = jax.vmap(stage_forward, spmd_axis_name=spmd)

    # The weight gradients' sums over the data-parallel rows wait for the end of the step. A stage's backward, the
    # head's and the embedding's run each device's rows as a group of their own (``sharding.row_groups``), so no
    # iteration sums their weight gradients over those axes; the accumulators keep one sum per group and the
    # loop's end adds them (one reduction a step where every iteration had one). Left out: axes that also split a
    # weight (fsdp, expert: their gradients are reduce-scattered per iteration; with the stages' weights gathered
    # once, every axis of the rows), and MoE stacks (their balancing losses couple the rows of a microbatch)
    is_var = lambda x: isinstance(x, nnx.Variable)
    stack_names = [logical_names(v)[1:] for v in jax.tree.leaves(periods_0, is_leaf=is_var)]
    groups = () if mesh.empty or stats_shape else row_groups(params, dict(mesh.shape), schedule.gather_once)
    g_ = int(np.prod([mesh.shape[a] for a in groups])) if groups else 1

    def split(a, axis=0):
        """[..., b, ...] -> [G, ..., b / G, ...]: each group's rows (the rows' dimension at ``axis``)."""
        return jnp.moveaxis(a.reshape(*a.shape[:axis], g_, a.shape[axis] // g_, *a.shape[axis + 1:]), axis, 0)

    def by_groups(fn, in_axes, *args):
        """``fn`` on each group of rows apart (``sharding.group_map``); what it returns has the groups' dimension
        first (of one, with one group). ``in_axes`` per argument: None (the same for every group), the axis of its
        rows (split into the groups), or 'grouped' (it has the groups' dimension first already)."""
        if g_ == 1:
            args = [jax.tree.map(lambda x: x[0], a) if axis == "grouped" else a
                    for a, axis in zip(args, in_axes, strict=True)]
            return jax.tree.map(lambda a: a[None], fn(*args))
        args = [a if axis in (None, "grouped") else jax.tree.map(lambda x, axis=axis: split(x, axis), a)
                for a, axis in zip(args, in_axes, strict=True)]
        return group_map(fn, groups, tuple(None if axis is None else 0 for axis in in_axes))(*args)

    def split_as_weights(grads, names):
        """The gradients the conditional backward makes, reduce-scattered there over fsdp
        (``constrain_gathered_gradients``); with the stages' weights gathered once, whole as the accumulators."""
        return grads if schedule.gather_once else constrain_gathered_gradients(grads, names)

    def backward_one(stack_s, acc, inputs, ex, s, v, dy, valid):
        """The stage's backward of its chunk ``v``, period by period from the last: each period's forward
        recomputed from its kept input (``inputs`` [pc, ...]) and its vector-Jacobian product taken at once, its
        weight gradients added into the stage's accumulator ``acc`` [P, ...] in place (no stage-sized gradient of
        one microbatch is ever whole). -> (the accumulator, the input gradient)."""
        def vjp(dy, p):
            _, pullback = jax.vjp(lambda w, x: period(w, x, ex, s, v * pc + p), weights_of(stack_s, v * pc + p),
                                  jax.lax.dynamic_index_in_dim(inputs, p, 0, False))
            dw, dx = pullback((dy, stats_cotangent(s, v * pc + p, valid)))
            return jax.tree.unflatten(jax.tree.structure(dw), split_as_weights(jax.tree.leaves(dw), stack_names)), dx

        def one(carry, p):
            dy, acc = carry
            dw, dx = when(_ACTIVE[-1], vjp, dy, p)  # the fill's iterations run no backward
            at = v * pc + p
            acc = jax.tree.map(lambda a, d: jax.lax.dynamic_update_index_in_dim(
                a, jax.lax.dynamic_index_in_dim(a, at, 0, False) + d.astype(a.dtype), at, 0), acc, dw)
            return (dx, acc), None
        (dx, acc), _ = jax.lax.scan(one, (dy * valid.astype(dy.dtype), acc), jnp.arange(pc), reverse=True)
        return acc, dx

    def backward_groups(stack_s, acc, inputs, ex, s, v, dy, valid):
        """``backward_one`` on each group of rows apart, each into its own accumulator (``acc`` [G, P, ...])."""
        acc, dx = by_groups(backward_one, (None, "grouped", 1, 0, None, None, 0, None), stack_s, acc, inputs, ex, s,
                            v, dy, valid)
        return acc, dx.reshape(dy.shape)

    backward_all = jax.vmap(backward_groups, spmd_axis_name=spmd)

    def on_stages(tree):
        """Hidden states [S, ..., b, T, D] and extras [S, ..., b, T] constrained in full (left to propagation,
        the zeros that start the stash and the buffers come out whole on every device, and so do the
        recomputations that read them)."""
        return constrain_on_stages(tree, x_shape.shape, EMBED_AXES)

    keep = timetable.kept(s_, v_)  # units whose inputs a stage holds between their forward and their backward
    # the accumulators, float32, one per group of rows, and sharded as their parameters: left unconstrained, XLA
    # keeps them whole on every device. The staged weights' gradients gather in ``grad_stack`` [S, G, P, ...];
    # ``grad_rest`` [G, ...] holds those of the other parameters (the staged ones' get none from ``pre`` and
    # ``post``: a zero stands in for them)
    param_names = [logical_names(v) for v in jax.tree.leaves(params, is_leaf=is_var)]
    in_stack = [names[:1] == ("layers",) for names in param_names]
    stack_def = jax.tree.structure(staged)
    params_def = jax.tree.structure(params)

    def rest_sharded(leaves):
        """The rest's accumulators [G, ...], one per group of rows (their sum over the groups waits for the end)."""
        return [a if staged_leaf else constrain_groups(a, groups, names)
                for a, names, staged_leaf in zip(leaves, param_names, in_stack, strict=True)]

    def stack_sharded(leaves):
        return [constrain_stage_groups(a, groups, names, schedule.gather_once)
                for a, names in zip(leaves, stack_names, strict=True)]

    # the head's and the embedding's backward differentiate the parameters outside the stack only (a gradient for
    # the stack, zeros, would be made whole and carried through the groups' vmap)
    param_leaves = jax.tree.leaves(params)
    rest_leaves = [a for a, staged_leaf in zip(param_leaves, in_stack, strict=True) if not staged_leaf]

    def with_rest(rest):
        """The parameters with ``rest`` in place of those outside the stack."""
        it = iter(rest)
        return jax.tree.unflatten(params_def, [a if staged_leaf else next(it)
                                               for a, staged_leaf in zip(param_leaves, in_stack, strict=True)])

    def rest_of(d_rest):
        """The gradients ``d_rest`` of the parameters outside the stack, as ``grad_rest`` holds them (a zero for each
        staged one; [G] with the groups' dimension)."""
        it = iter(split_as_weights(d_rest, [n for n, staged in zip(param_names, in_stack, strict=True) if not staged]))
        return [jnp.zeros((), jnp.float32) if staged_leaf else next(it).astype(jnp.float32) for staged_leaf in in_stack]

    def add_rest(acc, d):
        return rest_sharded([g + a for g, a in zip(acc, d, strict=True)])

    def when(active, fn, *args):
        """``fn(*args)`` where ``active`` (the same on every device), else zeros of its shapes: the fill runs no
        backward and the drain no forward. Only per-iteration values pass through the branch; the buffers that
        live through the loop (the stash, the accumulators) are updated outside it, so that XLA keeps one copy
        of each."""
        shapes = jax.eval_shape(fn, *args)
        return jax.lax.cond(active, fn, lambda *_: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes),
                            *args)

    def forward_phase(t, moving):
        """Every stage's forward, and the head and loss of the microbatch the last stage finished (with their
        gradients: ``d_h`` for the stack's output, the rest's for the parameters outside the stack)."""
        # stage s runs its forward unit t - s: stage 0 embeds a microbatch for chunk 0, or takes what stage S - 1
        # handed on for a later chunk
        _, m_in, v_in = unit(timetable.forward_unit(t, 0))
        x0, ex0, _, _ = pre(params, pick(m_in))
        fresh = v_in == 0
        inputs = on_stages((moving[0].at[0].set(jnp.where(fresh, x0, moving[0][0])),
                            jax.tree.map(lambda a, b: a.at[0].set(jnp.where(fresh, b, a[0])), moving[1], ex0)))
        _, _, chunks = unit(timetable.forward_unit(t, stage_ids))
        out, stats, period_inputs = forward_all(staged, inputs[0], inputs[1], stage_ids, chunks)
        last_valid, m_head, last_chunk = unit(timetable.forward_unit(t, s_ - 1))
        valid_h = (last_valid & (last_chunk == v_ - 1)).astype(jnp.float32)

        def head(h, mb):
            _, pullback, (ce, n, mtp_ce, mtp_stats) = jax.vjp(lambda r, h: post(with_rest(r), h, mb), rest_leaves,
                                                              h, has_aux=True)
            d_rest, d_h = pullback(valid_h)
            mtp = jax.tree.map(lambda a: valid_h * a.astype(jnp.float32), (mtp_ce, mtp_stats))
            return rest_of(d_rest), d_h.astype(x_shape.dtype), valid_h * ce, valid_h * n, mtp

        # every iteration, masked where the last stage finished no microbatch (interleaved: V - 1 of V): behind a
        # condition, GPT-3 175B's step held 12 GiB more per device (compiled for H100s, 32 layers on
        # pipeline=8 data=4 tensor=4), for a head of 0.4% of its FLOPs
        d_post, d_h, ce, n, mtp = by_groups(head, (0, 0), out[s_ - 1], pick(m_head))
        d_h = d_h.reshape(x_shape.shape)  # the groups' rows back in place
        return (out, inputs[1], stats, on_stages(period_inputs), d_post, d_h, jnp.sum(ce), jnp.sum(n),
                jax.tree.map(lambda a: jnp.sum(a, axis=0), mtp))

    def backward_phase(t, back, d_h, stash, grad_stack):
        """Every stage's backward (the last stage's gradient from the loss, ``d_h``) into its accumulator, and stage
        0's input gradient back through the embedding (and the dense prefix); -> (the gradients moving back, the
        accumulators, the rest's gradients)."""
        # stage s runs its backward unit t - (VS - 1) - (S - 1 - s): the last stage's chunk V - 1 of the
        # microbatch whose loss this iteration computed, or what stage 0 handed back from a later chunk
        active = t >= timetable.first_backward(s_, v_)
        j = timetable.backward_unit(t, stage_ids, s_, v_)
        valid_b, _, chunks = unit(j, backward=True)
        slot_b = timetable.forward_unit_of_backward(j, s_, v_) % keep  # where that microbatch and chunk's inputs are
        saved = on_stages(jax.vmap(lambda st, i: jax.tree.map(
            lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), st))(stash, slot_b))
        dy = on_stages(back.at[s_ - 1].set(jnp.where(chunks[s_ - 1] == v_ - 1, d_h, back[s_ - 1])))
        with _active(active):
            grad_stack, dx = backward_all(staged, jax.tree.unflatten(stack_def, grad_stack), saved[0], saved[1],
                                          stage_ids, chunks, dy, valid_b)
        grad_stack = stack_sharded(jax.tree.leaves(grad_stack))
        first_valid, m_first, first_chunk = unit(timetable.backward_unit(t, 0, s_, v_), backward=True)
        valid_0 = first_valid & (first_chunk == 0)  # (only in an iteration that runs the backward phase)

        def embedding_backward(dx0, mb):
            _, pre_pullback = jax.vjp(lambda r: pre(with_rest(r), mb)[0], rest_leaves)
            return rest_of(pre_pullback(dx0)[0])

        d_pre = when(valid_0, lambda dx0, mb: by_groups(embedding_backward, (0, 0), dx0, mb),
                     dx[0] * valid_0.astype(dx.dtype), pick(m_first))
        return on_stages(jnp.roll(dx, -1, axis=0)), grad_stack, d_pre

    def iteration(carry, t):
        """The forward phase while microbatches enter (t < M + S - 1), the backward phase once the first one
        reached the loss (t >= S - 1): the same branch on every device, so the fill carries no backward and the
        drain no forward."""
        moving, back, stash, grad_stack, grad_rest, sums, stats_sum, mtp_sum = carry
        with jax.named_scope(FORWARD_PHASE):  # the trace times the phases by these names (metrics/bubble.py)
            out, ex, stats, period_inputs, d_post, d_h, ce, n, mtp = when(
                t < timetable.forward_iterations(s_, m_, v_), forward_phase, t, moving)
        valid_f, _, chunks = unit(timetable.forward_unit(t, stage_ids))
        slot_f = timetable.forward_unit(t, stage_ids) % keep
        stash = on_stages(jax.vmap(lambda st, x, i, v: jax.tree.map(
            lambda a, b: jnp.where(v, jax.lax.dynamic_update_index_in_dim(a, b, i, 0), a), st, x))(
            stash, (period_inputs, ex), slot_f, valid_f))
        stats_sum = jax.tree.map(lambda acc, a: jax.vmap(
            lambda acc_s, a_s, v, ok: jax.lax.dynamic_update_slice_in_dim(
                acc_s, jax.lax.dynamic_slice_in_dim(acc_s, v * pc, pc, 0) + jnp.where(ok, a_s.astype(jnp.float32), 0.0),
                v * pc, 0))(acc, a, chunks, valid_f), stats_sum, stats)
        moving = on_stages(jax.tree.map(lambda a: jnp.roll(a, 1, axis=0), (out, ex)))
        with jax.named_scope(BACKWARD_PHASE):
            back, grad_stack, d_pre = backward_phase(t, back, d_h, stash, grad_stack)
        grad_rest = add_rest(add_rest(grad_rest, d_post), d_pre)
        return (moving, back, stash, grad_stack, grad_rest, (sums[0] + ce, sums[1] + n), stats_sum,
                jax.tree.map(jnp.add, mtp_sum, mtp)), None

    # the prediction modules' cross-entropy sums and routing stats, summed over the microbatches
    mtp_zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32),
                             jax.eval_shape(lambda h: post(params, h, first)[1][2:], x_shape))
    start = (on_stages((zeros(x_shape, (s_,)), zeros(ex_shape, (s_,)))), on_stages(zeros(x_shape, (s_,))),
             on_stages((zeros(x_shape, (s_, keep, pc)), zeros(ex_shape, (s_, keep)))),
             stack_sharded([jnp.zeros((s_, g_, *a.shape[1:]), jnp.float32) for a in jax.tree.leaves(staged)]),
             rest_sharded([jnp.zeros((g_,) if staged_leaf else (g_, *a.shape), jnp.float32)
                           for a, staged_leaf in zip(jax.tree.leaves(params), in_stack, strict=True)]),
             (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)),
             jax.tree.map(lambda a: jnp.zeros((s_, v_ * a.shape[0], *a.shape[1:]), jnp.float32), stats_shape),
             mtp_zeros)
    with jax.named_scope(SCOPE):  # the loop's HLO ops carry the name (profiles find its iterations by it)
        (_, _, _, grad_stack, grad_rest, (ce_sum, n_sum), stats_sum, (mtp_ce, mtp_stats)), _ = jax.lax.scan(
            iteration, start, jnp.arange(timetable.iterations(s_, m_, v_)))
    # the groups' sums, reduce-scattered onto the distributed optimizer's shards where it runs
    grad_stack = jax.tree.unflatten(stack_def, [
        constrain_gradient(jnp.sum(g, axis=1), ("stages", "layers", *names), setup.distributed_optimizer)
        for g, names in zip(grad_stack, stack_names, strict=True)])
    (d_from_stack,) = to_params(jax.tree.map(lambda g, a: g.reshape(a.shape).astype(a.dtype), grad_stack, periods_0))
    grads = jax.tree.unflatten(params_def, [
        (a.astype(jnp.float32) + (0.0 if staged_leaf else jnp.sum(b, axis=0))).astype(p.dtype)
        for a, b, p, staged_leaf in zip(jax.tree.leaves(d_from_stack), grad_rest, jax.tree.leaves(params), in_stack,
                                        strict=True)])
    order = storage_order(stack_size - schedule.pads, s_, v_)  # the model's period at each stored slot
    real = np.nonzero(order != PAD)[0]
    natural = real[np.argsort(order[real])]  # the stored slot of each of the model's periods, in its order
    stats = jax.tree.map(lambda a, b: jnp.concatenate([(a / m_).reshape(s_ * per, *a.shape[2:])[natural], b / m_]),
                         stats_sum, mtp_stats) if mtp_stats else \
        jax.tree.map(lambda a: (a / m_).reshape(s_ * per, *a.shape[2:])[natural], stats_sum)
    metrics = moe_metrics(stats)
    if depth:  # the modules' loss as the fill-drain step reports it: the mean over depths of each one's mean
        metrics["mtp_loss"] = jnp.mean(mtp_ce / jnp.maximum(valid_k, 1.0))
    return grads, ce_sum, n_sum, metrics
