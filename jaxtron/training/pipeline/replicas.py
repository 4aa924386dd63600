"""The replicas of a step's rows (``Replicas``): devices that hold the same weights and rows of their own
(``sharding.replica_axes``). Each replica accumulates its own weight gradients, so that they are summed over the
replicas once, at the step's end. ``ScheduleReplicas`` runs a 1F1B step's backward passes (the stages', the
head's and the embedding's) that way; ``when`` is the branch a phase runs in."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.parallel.sharding import (
    constrain,
    gathered_axes,
    logical_names,
    replica_axes,
    replica_map,
    replica_spec,
)


class Replicas:
    """Each device's rows along the mesh axes ``axes`` (``sharding.replica_axes``) as a replica of its own. A
    function mapped over the replicas (``map``) makes one result per replica. Gradients summed per replica need no
    sum over those axes until the replicas' results are added, once (the train step's microbatches, the 1F1B
    schedule's iterations)."""

    def __init__(self, axes: tuple[str, ...]):
        mesh = jax.sharding.get_abstract_mesh()
        self.axes = tuple(axes)
        self.count = int(np.prod([mesh.shape[a] for a in self.axes])) if self.axes else 1

    def constrain(self, leaves, names, staged: bool = False, whole: bool = False):
        """Per-replica arrays [R, ..., *names] (``staged``: [S, R, ..., *names]) held in ``replica_spec``'s
        layout: the replicas' dimension over their axes."""
        return [constrain(a, replica_spec(self.axes, n, a.ndim, staged, whole))
                for a, n in zip(leaves, names, strict=True)]

    def split(self, a, axis=0):
        """[..., b, ...] -> [R, ..., b / R, ...]: each replica's rows (the rows' dimension at ``axis``)."""
        r_ = self.count
        return jnp.moveaxis(a.reshape(*a.shape[:axis], r_, a.shape[axis] // r_, *a.shape[axis + 1:]), axis, 0)

    def map(self, fn, in_axes, *args):
        """``fn`` on each replica's rows apart (``sharding.replica_map``); what it returns has the replicas'
        dimension first (of one, with one replica). ``in_axes`` per argument: None (the same for every replica),
        the axis of its rows (split into the replicas), or 'per_replica' (it has the replicas' dimension first
        already)."""
        if self.count == 1:
            args = [jax.tree.map(lambda x: x[0], a) if axis == "per_replica" else a
                    for a, axis in zip(args, in_axes, strict=True)]
            return jax.tree.map(lambda a: a[None], fn(*args))
        args = [a if axis in (None, "per_replica") else jax.tree.map(lambda x, axis=axis: self.split(x, axis), a)
                for a, axis in zip(args, in_axes, strict=True)]
        return replica_map(fn, self.axes, tuple(None if axis is None else 0 for axis in in_axes))(*args)


class ScheduleReplicas(Replicas):
    """The weight gradients' sums over the replicas wait for the end of the step. A stage's backward, the head's and
    the embedding's run each replica's rows apart (``sharding.replica_axes``), so no iteration sums their weight
    gradients over those axes; the accumulators keep one sum per replica and the loop's end adds them (one
    reduction a step where every iteration had one). Left out: axes that also split a weight
    (fsdp, expert: their gradients are reduce-scattered per iteration; with the stages' weights gathered once,
    every axis of the rows), and MoE stacks (their balancing losses couple the rows of a microbatch)."""

    def __init__(self, params: Any, periods: Any, schedule, mesh, moe: bool):
        is_var = lambda x: isinstance(x, nnx.Variable)
        self.gather_once = schedule.gather_once
        self.stack_names = [logical_names(v)[1:] for v in jax.tree.leaves(periods, is_leaf=is_var)]
        super().__init__(() if mesh.empty or moe else replica_axes(params, dict(mesh.shape), schedule.gather_once))
        self.param_names = [logical_names(v) for v in jax.tree.leaves(params, is_leaf=is_var)]
        self.in_stack = [names[:1] == ("layers",) for names in self.param_names]
        self.params_def = jax.tree.structure(params)
        self.param_leaves = jax.tree.leaves(params)
        # the head's and the embedding's backward differentiate the parameters outside the stack only (a gradient
        # for the stack, zeros, would be made whole and carried through the replicas' vmap)
        self.rest_leaves = [a for a, staged in zip(self.param_leaves, self.in_stack, strict=True) if not staged]

    def as_weights(self, grads, names):
        """The gradients the conditional backward makes. Those of weights gathered before use (fsdp) are held as
        the weights, so XLA reduce-scatters them there; left alone, it may sum them whole (an all-reduce, twice the
        bytes: a gradient leaving a conditional) and slice after. With the stages' weights gathered once, all are
        whole, as the accumulators."""
        if self.gather_once:
            return grads
        sizes = dict(jax.sharding.get_abstract_mesh().shape)
        return [constrain(g, n) if any(gathered_axes(n, sizes)) else g for g, n in zip(grads, names, strict=True)]

    def rest_sharded(self, leaves):
        """The rest's accumulators [S, R, ...], one per stage and replica (their sum over both waits for the
        end): stage 0 adds the embedding's gradients, each stage those of its piece of the head's tokens."""
        return [a if staged else self.constrain([a], [names], staged=True)[0]
                for a, names, staged in zip(leaves, self.param_names, self.in_stack, strict=True)]

    def stack_sharded(self, leaves):
        """The stack's accumulators [S, R, P, ...], one per stage and replica."""
        return self.constrain(leaves, self.stack_names, staged=True, whole=self.gather_once)

    def with_rest(self, rest):
        """The parameters with ``rest`` in place of those outside the stack."""
        it = iter(rest)
        return jax.tree.unflatten(self.params_def, [a if staged else next(it)
                                                    for a, staged in zip(self.param_leaves, self.in_stack,
                                                                         strict=True)])

    def rest_of(self, d_rest):
        """The gradients ``d_rest`` of the parameters outside the stack, as ``grad_rest`` holds them (a zero for
        each staged one; [R] with the replicas' dimension)."""
        names = [n for n, staged in zip(self.param_names, self.in_stack, strict=True) if not staged]
        it = iter(self.as_weights(d_rest, names))
        return [jnp.zeros((), jnp.float32) if staged else next(it).astype(jnp.float32) for staged in self.in_stack]

    def add_rest(self, acc, d):
        return self.rest_sharded([g + a for g, a in zip(acc, d, strict=True)])


def when(active, fn, *args):
    """``fn(*args)`` where ``active`` (the same on every device), else zeros of its shapes: the fill runs no
    backward and the drain no forward. Only per-iteration values pass through the branch; the buffers that live
    through the loop (the stash, the accumulators) are updated outside it, so that XLA keeps one copy of each."""
    shapes = jax.eval_shape(fn, *args)
    return jax.lax.cond(active, fn, lambda *_: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes), *args)
