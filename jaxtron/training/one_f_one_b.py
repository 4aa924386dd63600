"""The 1F1B pipeline schedule (``pipeline.schedule='1f1b'``): the microbatches' forward and backward passes
interleaved in one SPMD program, the loss computed inside the schedule.

With S stages and M microbatches, iteration t runs on every stage s (one program, vmapped over the stage
dimension that the rules table shards over the pipeline axis, as ``pipeline.py``'s fill-drain does):

- the forward of microbatch t - s: stage 0 embeds microbatch t (and runs the dense prefix), the others take what
  stage s - 1 sent; the stage keeps its input, nothing else;
- on the last stage, the head and the loss of the microbatch it just finished, with their gradient;
- the backward of microbatch t - 2(S - 1) + s: the stage's forward recomputed from the input it kept, and its
  vector-Jacobian product with the gradient stage s + 1 sent (the last stage: the loss's); the parameters'
  gradients are summed as they come, and stage 0 passes its input gradient back through the embedding.

Then the activations move one stage on and the gradients one stage back (two collective permutes). A stage keeps
the inputs of the microbatches between its forward and its backward, at most 2S - 1 (stage 0), whatever M is;
fill-drain keeps every microbatch's. The schedule runs M + 2(S - 1) iterations: the first S - 1 carry no backward
and the last S - 1 no forward, and each iteration's time is a forward and a backward on every stage, so the idle
share is (2S - 2) / (M + 2S - 2) against fill-drain's (S - 1) / (M + S - 1) (the lockstep of one SPMD program:
a stage cannot start its next forward before the others finish their backward).

The objective is the fill-drain schedule's: the cross-entropy (and z-loss) sums of the microbatches, and the MoE
auxiliary losses as the token count times their mean over blocks and microbatches, so both schedules compute the
same gradients. The model is the one the training step runs: its forward up to the layer stack (``pre``) and from
it (``post``) are the train step's own loss with a stack runner that hands the stack's input out (``_Capture``) or
takes its output in (``_Replace``); the stack's periods run as ``body`` under the model's remat policy.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtron.models.stack import scan_stack
from jaxtron.parallel.sharding import BATCH_AXES, constrain, constrain_leading, logical_to_spec, spec_axes
from jaxtron.parallel.stages import identity_slots
from jaxtron.training.pipeline import check_schedule, split_rows

Batch = dict[str, jax.Array]


class _Capture:
    """A stack runner that runs nothing: it records the body, the stack's input, its periods and extras, and hands
    the input on unchanged (with zero stats of the right shape)."""

    def __init__(self):
        self.seen: tuple | None = None

    def __call__(self, body, x, stack, extras):
        if self.seen is not None:
            raise ValueError("the 1f1b schedule runs one group of stacked blocks")
        self.seen = (body, x, stack, extras)
        stats = jax.eval_shape(lambda: scan_stack(body, x, stack, extras))[1]
        return x, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats)


class _Replace:
    """A stack runner that returns ``hidden`` as the stack's output (no stats: the MoE losses are counted by the
    schedule)."""

    def __init__(self, hidden: jax.Array):
        self.hidden = hidden

    def __call__(self, body, x, stack, extras):
        return self.hidden, {}


def gradients(setup, params: Any, batch: Batch) -> tuple[Any, jax.Array, jax.Array, dict]:
    """(summed gradients, cross-entropy sum, token count, MoE metrics) of the batch under the 1F1B schedule of
    ``setup.stack_runner``; the same numbers as ``step.gradients`` with the fill-drain schedule."""
    from jaxtron.training.step import loss_sums, moe_metrics

    schedule = setup.stack_runner
    s_, m_ = schedule.stages, schedule.microbatches
    micro = jax.tree.map(lambda a: split_rows(a, m_), batch)  # [M, b, ...]
    weights = batch.get("loss_mask")
    count = jnp.sum(jnp.ones(batch["targets"].shape, jnp.float32) if weights is None else weights.astype(jnp.float32))
    common = dict(graphdef=setup.graphdef, logit_chunks=setup.logit_chunks, mtp_loss=None)

    def pick(t):
        return {k: constrain(jax.lax.dynamic_index_in_dim(v, jnp.clip(t, 0, m_ - 1), 0, False), BATCH_AXES)
                for k, v in micro.items()}

    def pre(p, mb):
        """-> (the stack's input, its extras, its periods, body) of microbatch ``mb``."""
        capture = _Capture()
        loss_sums(p, batch=mb, z_loss=0.0, stack_runner=capture, **common)
        if capture.seen is None:
            raise ValueError("the model has no stacked blocks for the 1f1b schedule to run")
        body, x, stack, extras = capture.seen
        return x, extras, stack, body

    def post(p, h, mb):
        """-> (cross-entropy plus z-loss sums, (cross-entropy sum, token count)) of ``h``, the stack's output."""
        objective, (ce, n, _) = loss_sums(p, batch=mb, z_loss=setup.z_loss, stack_runner=_Replace(h), **common)
        return objective, (ce, n)

    first = pick(0)
    _, _, periods_0, body = pre(params, first)
    _, to_params = jax.vjp(lambda p: pre(p, first)[2], params)  # the stack's periods from the parameters
    stack_size = jax.tree.leaves(periods_0)[0].shape[0]
    check_schedule(stack_size, s_, 1, m_)
    per = stack_size // s_
    identity = jnp.asarray(identity_slots(stack_size - schedule.pads, s_, 1)[:, 0])  # [S, P]
    staged = jax.tree.map(lambda a: constrain_leading(a.reshape(s_, per, *a.shape[1:]), "stages"), periods_0)
    stage_ids = jnp.arange(s_)

    def stage_forward(stack_s, h, ex, s):
        def one(h, p):
            weights_p = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, p, 0, False), stack_s)
            out, stats = body(h, weights_p, ex)
            return jnp.where(identity[s, p], h, out), stats
        return jax.lax.scan(one, h, jnp.arange(per))

    # the MoE losses' gradient: the token count times the coefficient over (MoE blocks x microbatches), for each
    # block's stats of each microbatch; identity periods get none
    stats_shape = jax.eval_shape(lambda: stage_forward(jax.tree.map(lambda a: a[0], staged),
                                                       pre(params, first)[0], pre(params, first)[1], 0))[1]
    blocks = stack_size - schedule.pads
    coefficient = {"aux_loss": setup.router_aux_loss, "z_loss": setup.router_z_loss}

    def stats_cotangent(s, valid):
        scale = count / (blocks * m_) * valid.astype(jnp.float32)
        real = ~identity[s]  # [P]
        return {k: (jnp.where(real.reshape(-1, *(1,) * (len(v.shape) - 1)), scale * coefficient.get(k, 0.0), 0.0)
                    * jnp.ones(v.shape, jnp.float32)).astype(v.dtype) for k, v in stats_shape.items()}

    mesh = jax.sharding.get_abstract_mesh()
    spmd = None if mesh.empty else spec_axes(logical_to_spec(("stages",)), 0) or None
    forward_all = jax.vmap(stage_forward, spmd_axis_name=spmd)

    def backward_one(stack_s, h, ex, s, dy, valid):
        _, pullback = jax.vjp(lambda w, x: stage_forward(w, x, ex, s), stack_s, h)
        return pullback((dy * valid.astype(dy.dtype), stats_cotangent(s, valid)))

    backward_all = jax.vmap(backward_one, spmd_axis_name=spmd)

    def on_stages(tree):
        return jax.tree.map(lambda a: constrain_leading(a, "stages"), tree)

    x_shape = jax.eval_shape(lambda: pre(params, first)[0])
    ex_shape = jax.eval_shape(lambda: pre(params, first)[1])
    keep = 2 * s_ - 1  # inputs a stage holds between a microbatch's forward and its backward
    zeros = lambda shape, lead: jax.tree.map(lambda a: jnp.zeros((*lead, *a.shape), a.dtype), shape)
    f32 = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)

    def iteration(carry, t):
        moving, back, stash, grad_stack, grad_rest, sums, stats_sum = carry
        # forward: stage 0 takes microbatch t, stage s works on microbatch t - s
        x0, ex0, _, _ = pre(params, pick(t))
        inputs = on_stages((moving[0].at[0].set(x0), jax.tree.map(lambda a, b: a.at[0].set(b), moving[1], ex0)))
        out, stats = forward_all(staged, inputs[0], inputs[1], stage_ids)
        valid_f = (t - stage_ids >= 0) & (t - stage_ids < m_)
        slot_f = (t - stage_ids) % keep
        stash = on_stages(jax.vmap(lambda st, x, i, v: jax.tree.map(
            lambda a, b: jnp.where(v, jax.lax.dynamic_update_index_in_dim(a, b, i, 0), a), st, x))(
            stash, inputs, slot_f, valid_f))
        stats_sum = jax.tree.map(
            lambda acc, a: acc + jnp.where(valid_f.reshape(-1, *(1,) * (a.ndim - 1)), a.astype(jnp.float32), 0.0),
            stats_sum, stats)
        # the head and the loss of the microbatch the last stage finished
        m_head = t - (s_ - 1)
        valid_h = ((m_head >= 0) & (m_head < m_)).astype(jnp.float32)
        _, pullback, (ce, n) = jax.vjp(lambda p, h: post(p, h, pick(m_head)), params, out[s_ - 1], has_aux=True)
        d_params_post, d_h = pullback(valid_h)
        sums = (sums[0] + valid_h * ce, sums[1] + valid_h * n)
        # backward: stage s on microbatch t - 2(S - 1) + s, the last stage's gradient from the loss
        valid_b = (t - 2 * (s_ - 1) + stage_ids >= 0) & (t - 2 * (s_ - 1) + stage_ids < m_)
        slot_b = (t - 2 * (s_ - 1) + stage_ids) % keep
        saved = on_stages(jax.vmap(lambda st, i: jax.tree.map(
            lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), st))(stash, slot_b))
        dy = on_stages(back.at[s_ - 1].set(d_h.astype(back.dtype)))
        d_stack, dx = backward_all(staged, saved[0], saved[1], stage_ids, dy, valid_b)
        grad_stack = jax.tree.map(lambda g, d: g + d.astype(jnp.float32), grad_stack, d_stack)
        # stage 0's input gradient back through the embedding (and the dense prefix)
        m_first = t - 2 * (s_ - 1)
        valid_0 = ((m_first >= 0) & (m_first < m_)).astype(dx.dtype)
        _, pre_pullback = jax.vjp(lambda p: pre(p, pick(m_first))[0], params)
        (d_params_pre,) = pre_pullback(dx[0] * valid_0)
        grad_rest = jax.tree.map(lambda g, a, b: g + a.astype(jnp.float32) + b.astype(jnp.float32), grad_rest,
                                 d_params_post, d_params_pre)
        moving = on_stages(jax.tree.map(lambda a: jnp.roll(a, 1, axis=0), (out, inputs[1])))
        back = on_stages(jnp.roll(dx, -1, axis=0))
        return (moving, back, stash, grad_stack, grad_rest, sums, stats_sum), None

    start = (on_stages((zeros(x_shape, (s_,)), zeros(ex_shape, (s_,)))), on_stages(zeros(x_shape, (s_,))),
             on_stages((zeros(x_shape, (s_, keep)), zeros(ex_shape, (s_, keep)))), f32(staged), f32(params),
             (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)),
             jax.tree.map(lambda a: jnp.zeros((s_, *a.shape), jnp.float32), stats_shape))
    (_, _, _, grad_stack, grad_rest, (ce_sum, n_sum), stats_sum), _ = jax.lax.scan(
        iteration, start, jnp.arange(m_ + 2 * (s_ - 1)))
    (d_from_stack,) = to_params(jax.tree.map(lambda g, a: g.reshape(a.shape).astype(a.dtype), grad_stack, periods_0))
    grads = jax.tree.map(lambda a, b, p: (a.astype(jnp.float32) + b).astype(p.dtype), d_from_stack, grad_rest,
                         params)
    real = np.nonzero(~np.asarray(identity_slots(stack_size - schedule.pads, s_, 1)).reshape(-1))[0]
    stats = jax.tree.map(lambda a: (a / m_).reshape(s_ * per, *a.shape[2:])[real], stats_sum)
    return grads, ce_sum, n_sum, moe_metrics(stats)
