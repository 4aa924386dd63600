"""Where a training state's arrays and its gradients live, on top of the rules table (``sharding``, still the one
map from logical names to mesh axes): parameters as their rules place them; under the distributed optimizer the
AdamW moments (and the gradient sums that feed them) split further over the batch's axes (``optimizer_spec``);
and the gradients of weights gathered before use (fsdp), which a reduce-scatter sums where they are made."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtron.parallel.sharding import constrain, is_variable, logical_names, logical_to_spec, spec_axes

# dimensions the distributed optimizer leaves to their rule where another takes its axes: a stacked-layers
# dimension cut further would make every layer's gradient go whole to one device inside the layer loop
_STACKED = {"layers", "unstaged_layers", "stages"}


def tree_shardings(mesh: Mesh, tree: Any, optimizer: bool = False) -> Any:
    """NamedShardings for a tree of nnx Variables (by their logical names) and plain arrays (replicated);
    ``optimizer``: the Variables are optimizer state of the distributed optimizer (``optimizer_spec``)."""

    def one(x):
        if not is_variable(x):
            return NamedSharding(mesh, PartitionSpec())
        if optimizer:
            return NamedSharding(mesh, optimizer_spec(logical_names(x), x.get_value().shape, dict(mesh.shape)))
        return NamedSharding(mesh, logical_to_spec(logical_names(x)))

    return jax.tree.map(one, tree, is_leaf=is_variable)


def _gathered_dims(names: Sequence[str | None], sizes: Mapping[str, int]) -> list[bool]:
    """Per dimension of a weight with these logical names: whether its rule cuts it over an axis of the batch (of
    more than one device; not the experts' axis), over which the weight is gathered before use (fsdp)."""
    spec = logical_to_spec(names)
    gathered = set(spec_axes(logical_to_spec(("activation_batch",)), 0)) - set(
        spec_axes(logical_to_spec(("experts",)), 0))
    return [any(a in gathered and sizes.get(a, 1) > 1 for a in spec_axes(spec, d)) for d in range(len(names))]


def optimizer_spec(names: Sequence[str | None], shape: Sequence[int], sizes: Mapping[str, int]) -> PartitionSpec:
    """The PartitionSpec of a parameter's optimizer state under the distributed optimizer: the parameter's own,
    with each axis of ``optimizer_state`` it does not use yet (and that has more than one device) added to the
    dimension that divides by it with the largest piece per device: a dimension the weight is gathered along
    first (fsdp, whose gradient is reduce-scattered along it: one reduce-scatter then sums over both), then
    dimensions no axis cuts yet, stacked-layer dimensions last. An axis no dimension divides by leaves the state
    replicated over it."""
    spec = [spec_axes(logical_to_spec(names), d) for d in range(len(shape))]
    used = {a for axes in spec for a in axes}
    gathered = _gathered_dims(names, sizes)
    for axis in spec_axes(logical_to_spec(("optimizer_state",)), 0):
        ways = sizes.get(axis, 1)
        if axis in used or ways == 1:
            continue
        piece = [shape[d] // math.prod(sizes.get(a, 1) for a in spec[d]) for d in range(len(shape))]
        fits = [d for d in range(len(shape)) if piece[d] % ways == 0]
        if not fits:
            continue
        cut = [any(sizes.get(a, 1) > 1 for a in axes) for axes in spec]
        best = max(fits, key=lambda d: (names[d] not in _STACKED, gathered[d], not cut[d], piece[d]))
        spec[best] += (axis,)
        used.add(axis)
    return PartitionSpec(*(None if not axes else axes[0] if len(axes) == 1 else axes for axes in spec))


def constrain_optimizer(tree: Any) -> Any:
    """Constrains a tree of Variables shaped like the parameters (their gradients) to the distributed
    optimizer's sharding (no-op without a mesh): XLA then reduce-scatters the gradient sums it would otherwise
    all-reduce."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return tree

    def one(x):
        if not is_variable(x):
            return x
        spec = optimizer_spec(logical_names(x), x.get_value().shape, dict(mesh.shape))
        return x.replace(jax.lax.with_sharding_constraint(x.get_value(), spec))

    return jax.tree.map(one, tree, is_leaf=is_variable)


def constrain_gradient(x: jax.Array, names: Sequence[str | None], optimizer: bool = False) -> jax.Array:
    """Constrains a gradient (or an accumulator of them) of a parameter with these logical names to the parameter's
    sharding, or with ``optimizer`` to the distributed optimizer's (no-op without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    if optimizer:
        return jax.lax.with_sharding_constraint(x, optimizer_spec(names, x.shape, dict(mesh.shape)))
    return constrain(x, names)


def constrain_gathered_gradients(grads: Sequence[jax.Array], names: Sequence[Sequence[str | None]]) -> list:
    """Gradients of weights with these logical names, those of weights gathered before use (fsdp) constrained as
    the weights: XLA sums them by a reduce-scatter where they are made, which it may otherwise do whole (an
    all-reduce, twice the bytes: a gradient leaving a conditional) and slice after; the others as they come (no-op
    without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return list(grads)
    sizes = dict(mesh.shape)
    return [constrain(a, n) if any(_gathered_dims(n, sizes)) else a for a, n in zip(grads, names, strict=True)]
