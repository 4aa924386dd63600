"""The rows of a 1F1B step in groups (``RowGroups``): each device's rows run the stages' backward, the head's and the
embedding's as a group of their own, so that the weight gradients are summed over the data-parallel rows once, at
the step's end; and ``when``, the branch a phase runs in."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.parallel.sharding import (
    constrain_groups,
    constrain_stage_groups,
    group_map,
    logical_names,
    row_groups,
)
from jaxtron.parallel.state_sharding import constrain_gathered_gradients


class Groups:
    """Each device's rows along the mesh axes ``groups`` (``sharding.row_groups``) as a group of their own: a
    function mapped over the groups (``map``) makes one result per group, and gradients summed per group need no
    sum over those axes until the groups' results are added, once (the train step's microbatches, the 1F1B
    schedule's iterations)."""

    def __init__(self, groups: tuple[str, ...]):
        mesh = jax.sharding.get_abstract_mesh()
        self.groups = tuple(groups)
        self.count = int(np.prod([mesh.shape[a] for a in self.groups])) if self.groups else 1

    def constrained(self, leaves, names):
        """Per-group accumulators [G, ...] of arrays with these logical ``names``, their group dimension over the
        groups' axes."""
        return [constrain_groups(a, self.groups, n) for a, n in zip(leaves, names, strict=True)]

    def split(self, a, axis=0):
        """[..., b, ...] -> [G, ..., b / G, ...]: each group's rows (the rows' dimension at ``axis``)."""
        g_ = self.count
        return jnp.moveaxis(a.reshape(*a.shape[:axis], g_, a.shape[axis] // g_, *a.shape[axis + 1:]), axis, 0)

    def map(self, fn, in_axes, *args):
        """``fn`` on each group of rows apart (``sharding.group_map``); what it returns has the groups' dimension
        first (of one, with one group). ``in_axes`` per argument: None (the same for every group), the axis of its
        rows (split into the groups), or 'grouped' (it has the groups' dimension first already)."""
        if self.count == 1:
            args = [jax.tree.map(lambda x: x[0], a) if axis == "grouped" else a
                    for a, axis in zip(args, in_axes, strict=True)]
            return jax.tree.map(lambda a: a[None], fn(*args))
        args = [a if axis in (None, "grouped") else jax.tree.map(lambda x, axis=axis: self.split(x, axis), a)
                for a, axis in zip(args, in_axes, strict=True)]
        return group_map(fn, self.groups, tuple(None if axis is None else 0 for axis in in_axes))(*args)


class RowGroups(Groups):
    """The weight gradients' sums over the data-parallel rows wait for the end of the step. A stage's backward,
    the head's and the embedding's run each device's rows as a group of their own (``sharding.row_groups``), so no
    iteration sums their weight gradients over those axes; the accumulators keep one sum per group and the loop's
    end adds them (one reduction a step where every iteration had one). Left out: axes that also split a weight
    (fsdp, expert: their gradients are reduce-scattered per iteration; with the stages' weights gathered once,
    every axis of the rows), and MoE stacks (their balancing losses couple the rows of a microbatch)."""

    def __init__(self, params: Any, periods: Any, schedule, mesh, moe: bool):
        is_var = lambda x: isinstance(x, nnx.Variable)
        self.gather_once = schedule.gather_once
        self.stack_names = [logical_names(v)[1:] for v in jax.tree.leaves(periods, is_leaf=is_var)]
        super().__init__(() if mesh.empty or moe else row_groups(params, dict(mesh.shape), schedule.gather_once))
        self.param_names = [logical_names(v) for v in jax.tree.leaves(params, is_leaf=is_var)]
        self.in_stack = [names[:1] == ("layers",) for names in self.param_names]
        self.params_def = jax.tree.structure(params)
        self.param_leaves = jax.tree.leaves(params)
        # the head's and the embedding's backward differentiate the parameters outside the stack only (a gradient
        # for the stack, zeros, would be made whole and carried through the groups' vmap)
        self.rest_leaves = [a for a, staged in zip(self.param_leaves, self.in_stack, strict=True) if not staged]

    def as_weights(self, grads, names):
        """The gradients the conditional backward makes, reduce-scattered there over fsdp
        (``constrain_gathered_gradients``); with the stages' weights gathered once, whole as the accumulators."""
        return grads if self.gather_once else constrain_gathered_gradients(grads, names)

    def rest_sharded(self, leaves):
        """The rest's accumulators [G, ...], one per group of rows (their sum over the groups waits for the end)."""
        return [a if staged else constrain_groups(a, self.groups, names)
                for a, names, staged in zip(leaves, self.param_names, self.in_stack, strict=True)]

    def stack_sharded(self, leaves):
        return [constrain_stage_groups(a, self.groups, names, self.gather_once)
                for a, names in zip(leaves, self.stack_names, strict=True)]

    def with_rest(self, rest):
        """The parameters with ``rest`` in place of those outside the stack."""
        it = iter(rest)
        return jax.tree.unflatten(self.params_def, [a if staged else next(it)
                                                    for a, staged in zip(self.param_leaves, self.in_stack,
                                                                         strict=True)])

    def rest_of(self, d_rest):
        """The gradients ``d_rest`` of the parameters outside the stack, as ``grad_rest`` holds them (a zero for
        each staged one; [G] with the groups' dimension)."""
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
