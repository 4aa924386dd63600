"""Where a training state's arrays and its gradients live, on top of the rules table (``sharding``, still the one
map from logical names to mesh axes): parameters as their rules place them; under the distributed optimizer the
AdamW moments (and the gradient sums that feed them) split further over the batch's axes (``optimizer_spec``);
the gradients of weights gathered before use (fsdp), which a reduce-scatter sums where they are made; and the
layouts a matmul's operands and their gradients take around it (``weight_layout``, ``gathered_einsum``,
``gathered_cotangent``)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtron.common.trace_state import GATHER_FOR_USE
from jaxtron.parallel.sharding import (
    constrain,
    gathered_axes,
    is_variable,
    logical_names,
    logical_to_spec,
    spec_axes,
    whole_over_batch,
)

# dimensions the distributed optimizer leaves to their rule where another takes its axes: a stacked-layers
# dimension cut further would make every layer's gradient go whole to one device inside the layer loop
_STACKED = {"layers", "unstaged_layers", "stages"}
# how projections use their fsdp-split weights (``gathering_for_use``): left to XLA (None), or gathered for use
# and the gathered copy kept for the backward pass or gathered again there
_GATHER_MODES = (None, "keep", "regather")


def whole_matrix_steps(names: Sequence[str | None], matrix: Sequence[int], sizes: Mapping[str, int]
                       ) -> list[PartitionSpec]:
    """The layouts by which a stack of matrices (its ``matrix`` dimensions, the others a batch: layers, experts)
    goes from its parameter's layout to one where each device holds whole matrices, its share of them (Muon runs
    its Newton-Schulz GEMMs there without gathering): first a split of the first batch dimension over the mesh axes
    that leave the parameter whole, such as data (a slice: their devices hold the same values), so that no two
    devices orthogonalize the same matrix, then one step per sharded matrix dimension, whose mesh axes move to the
    first batch dimension (an all-to-all over them). That dimension is padded to divide (``whole_matrix_stack``).
    [] where there is no batch dimension."""
    spec = logical_to_spec(names)
    batch = [i for i in range(len(names)) if i not in matrix]
    if not batch:
        return []
    first, steps = batch[0], []
    entries = [spec[i] if i < len(spec) else None for i in range(len(names))]
    stacked = [a for a in spec_axes(spec, first) if sizes.get(a, 1) > 1]
    used = {a for i in range(len(names)) for a in spec_axes(spec, i)}
    spread = [a for a, n in sizes.items() if n > 1 and a not in used]
    if spread:  # first, so that the all-to-alls move only the share each device keeps
        stacked += spread
        entries[first] = tuple(stacked)
        steps.append(PartitionSpec(*entries))
    for i in matrix:
        axes = [a for a in spec_axes(spec, i) if sizes.get(a, 1) > 1]
        if axes:
            stacked += axes
            entries[first], entries[i] = tuple(stacked), None
            steps.append(PartitionSpec(*entries))
    return steps


def whole_matrix_stack(names: Sequence[str | None], shape: Sequence[int], matrix: Sequence[int],
                       sizes: Mapping[str, int]) -> tuple[int, int]:
    """(the first batch dimension of a stack of matrices, its length padded to divide over the devices that
    ``whole_matrix_steps`` split it over); (-1, 0) where there is no batch dimension."""
    batch = [i for i in range(len(names)) if i not in matrix]
    if not batch:
        return -1, 0
    steps = whole_matrix_steps(names, matrix, sizes)
    devices = math.prod(sizes[a] for a in spec_axes(steps[-1], batch[0])) if steps else 1
    return batch[0], -(-shape[batch[0]] // devices) * devices


def to_whole_matrices(x: jax.Array, names: Sequence[str | None], matrix: Sequence[int]) -> jax.Array:
    """``x`` (shaped as a parameter of these logical ``names``) moved step by step to the layouts
    ``whole_matrix_steps`` gives, its stack padded with zero matrices to divide (``from_whole_matrices`` undoes
    both); as it is without a mesh."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    first, length = whole_matrix_stack(names, x.shape, matrix, sizes)
    if first >= 0 and length > x.shape[first]:
        x = jnp.pad(x, [(0, length - x.shape[first]) if i == first else (0, 0) for i in range(x.ndim)])
    for spec in whole_matrix_steps(names, matrix, sizes):
        x = jax.lax.with_sharding_constraint(x, spec)
    return x


def from_whole_matrices(x: jax.Array, names: Sequence[str | None], matrix: Sequence[int],
                        shape: Sequence[int]) -> jax.Array:
    """``x``, laid out by ``to_whole_matrices`` (and held there: whatever made it is computed there), back in the
    layout and ``shape`` of its parameter by the same steps in reverse: an all-gather over the axes that leave the
    parameter whole, then an all-to-all per matrix dimension."""
    if not jax.sharding.get_abstract_mesh().empty:
        for spec in whole_matrix_steps(names, matrix, dict(jax.sharding.get_abstract_mesh().shape))[::-1]:
            x = jax.lax.with_sharding_constraint(x, spec)
    if x.shape != tuple(shape):
        x = x[tuple(slice(0, n) for n in shape)]
    return constrain(x, names)


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
    more than one device), over which the weight is gathered before use (fsdp; an ``experts`` dimension is not
    gathered: ``whole_over_batch``)."""
    return [bool(axes) for axes in gathered_axes(names, sizes)]


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


def constrain_variables(tree: Any, optimizer: bool = False) -> Any:
    """Each Variable of ``tree`` (parameters, or their gradients) held in its parameter's layout or, with
    ``optimizer``, in the distributed optimizer's (``optimizer_spec``): XLA then reduce-scatters the gradient sums
    it would otherwise all-reduce. A no-op without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return tree
    sizes = dict(mesh.shape)

    def one(x):
        if not is_variable(x):
            return x
        names = logical_names(x)
        layout = optimizer_spec(names, x.get_value().shape, sizes) if optimizer else names
        return x.replace(constrain(x.get_value(), layout))

    return jax.tree.map(one, tree, is_leaf=is_variable)


def gathered_cotangent(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """``x`` unchanged, its cotangent constrained to the sharding ``names`` map to (no-op without a mesh).

    For a projection's output that a reduce-scatter splits afterwards: the backward pass then gathers the incoming
    gradient once, for both transposed matmuls (left to XLA, each gathered its own copy)."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return _resharded(x, None, logical_to_spec(names))


@contextlib.contextmanager
def gathering_for_use(mode: str | None = "keep"):
    """Within this context (while tracing) projections gather their fsdp-split weights for use (``weight_layout``),
    keeping the gathered copy for the backward pass (``"keep"``: a block its caller recomputes before its
    backward) or gathering it again there (``"regather"``: a block that keeps what its backward reads); ``None``
    leaves the weights to XLA."""
    if mode not in _GATHER_MODES:
        raise ValueError(f"gathering_for_use takes one of {_GATHER_MODES}, not {mode!r}")
    with GATHER_FOR_USE.bound(mode):
        yield


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """How a projection uses a weight split over the axes that split the batch's rows (fsdp): gathered
    (``use``: ``whole_over_batch``) for its matmul, its gradient constrained back to the weight's own sharding
    (``own``), so that the gradient's sum over those axes is a reduce-scatter where it is made; ``regather``: the
    backward pass gathers the weight again rather than keep the gathered copy."""

    use: PartitionSpec
    own: PartitionSpec
    regather: bool

    def gathered(self, w: jax.Array) -> jax.Array:
        """``w`` constrained to its layout for use (its cotangent left alone)."""
        return jax.lax.with_sharding_constraint(w, self.use)

    def scattered(self, grad: jax.Array) -> jax.Array:
        """A gradient of the weight constrained to the weight's own sharding."""
        return jax.lax.with_sharding_constraint(grad, self.own)


def weight_layout(names: Sequence[str | None], ndim: int) -> WeightLayout | None:
    """The ``WeightLayout`` of a weight of ``ndim`` dimensions (its trailing ones named ``names``), within
    ``gathering_for_use``; None without a mesh, outside that context, or for a weight no batch axis splits.

    Left to propagation, a matmul between rows split over fsdp and a weight split over fsdp may be partitioned
    otherwise: on meshes with fsdp, sequence and tensor axes together, XLA moved the output projections' weight
    shards onto the sequence axis (under a pipeline's stage vmap: with collective permutes), gathered the
    activations' whole length there and all-reduced the full-length output over the tensor group (Llama-3 70B,
    pipeline=4 fsdp=2 sequence=2 tensor=4); a plain constraint to the gathered sharding keeps the gradient whole
    too, an all-reduce of each weight's gradient. Decoding is left to XLA: a step may do better with the weight
    kept split."""
    mode = GATHER_FOR_USE.get()
    if mode is None or jax.sharding.get_abstract_mesh().empty:
        return None
    names = tuple(names)[len(names) - ndim:]
    use, own = whole_over_batch(names), logical_to_spec(names)
    return None if use == own else WeightLayout(use, own, regather=mode == "regather")


def gathered_einsum(equation: str, x: jax.Array, w: jax.Array, layout: WeightLayout | None = None,
                    matmul: Callable[[str, jax.Array, jax.Array], jax.Array] = jnp.einsum) -> jax.Array:
    """``matmul(equation, x, w)`` (default ``jnp.einsum``) of a projection (activation ``x``, weight ``w`` in the
    compute dtype) with the weight gathered for use as ``layout`` says (None: left to XLA). ``matmul``: a
    module-level function (a block-scaled recipe's, ``ops/block_scaled.py``), the same each call.

    Kept (``layout.regather`` false, a block under a checkpoint policy): only the weight's layout is constrained,
    so the policy sees the matmul. Gathered again: the matmul's backward keeps the weight's own shard and gathers
    it for the two transposed matmuls, as FSDP does (with the gathered copy kept, a block without a checkpoint
    would hold every layer's whole weights from its forward to its backward pass)."""
    if layout is None:
        return matmul(equation, x, w)
    if not layout.regather:
        return matmul(equation, x, _resharded(w, layout.use, layout.own))
    return _regathered_einsum(equation, x, w, layout, matmul)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def _regathered_einsum(equation: str, x: jax.Array, w: jax.Array, layout: WeightLayout, matmul) -> jax.Array:
    return matmul(equation, x, layout.gathered(w))


def _regathered_fwd(equation, x, w, layout, matmul):
    # the shard kept for the backward pass held as the weight is (left to propagation, XLA:CPU's fill-drain
    # pipeline kept it whole in every iteration)
    return _regathered_einsum(equation, x, w, layout, matmul), (x, layout.scattered(w))


def _regathered_bwd(equation, layout, matmul, res, grad):
    x, w = res
    _, pullback = jax.vjp(lambda a, b: matmul(equation, a, b), x, layout.gathered(w))
    dx, dw = pullback(grad)
    return dx, layout.scattered(dw)


_regathered_einsum.defvjp(_regathered_fwd, _regathered_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _resharded(x: jax.Array, forward: PartitionSpec | None, backward: PartitionSpec) -> jax.Array:
    """``x`` constrained to ``forward`` (None: left as it is), its cotangent to ``backward``."""
    return x if forward is None else jax.lax.with_sharding_constraint(x, forward)


_resharded.defvjp(lambda x, forward, backward: (_resharded(x, forward, backward), None),
                  lambda forward, backward, _, grad: (jax.lax.with_sharding_constraint(grad, backward),))
