"""THE logical-axis rules table and the helpers that turn logical names into shardings.

Models name the axes of every parameter and activation with logical names; this module alone
decides which mesh axes shard them. Changing the pipeline/data/fsdp/sequence/expert/tensor degrees is a config
change, never a model change; code that must name mesh axes itself (a ``shard_map``) asks this table which ones a
logical name maps to (``logical_to_spec``, ``spec_axes``, ``shard_count``).
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtron.common.trace_state import AXES_TAKEN, BATCH_OVER_STAGES

# logical axis name -> mesh axis (or axes, outermost first), None = replicated.
# A mesh axis already used by an earlier dimension of the same array is skipped for later ones.
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("vocab", "tensor"),
    # fsdp, and the expert axis beside it: the weights outside the experts (attention, dense and shared MLPs,
    # embedding, head) are split over every device their rows split over, as ZeRO-3 splits them over its data-parallel
    # group; an expert's weights keep the expert axis for their experts (a mesh axis is taken once per array)
    ("embed", ("fsdp", "expert")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    # the low-rank latents of multi-head latent attention: their up-projections ([latent, heads, head size], 3.2B
    # parameters in DeepSeek-V3) split as the weights beside them; the down-projections' embed takes the axes first
    ("latent", ("fsdp", "expert")),
    ("lora_rank", None),  # the rank of low-rank adapters (small: kept whole)
    ("mlp", "tensor"),
    ("experts", "expert"),
    ("layers", "pipeline"),  # the stacked blocks: one contiguous block of periods per pipeline stage
    # stacked blocks that run outside a pipeline schedule (an MoE model's dense prefix, the multi-token
    # prediction modules): every stage holds them whole
    ("unstaged_layers", None),
    ("norm", None),
    # biases and other vectors kept whole (the sigmoid router's balancing bias, gpt-oss's projection biases and
    # sinks); the optimizer gives them no weight decay, and Muon leaves them to AdamW
    ("bias", None),
    ("position", None),
    # activations
    ("activation_batch", ("data", "fsdp", "expert")),
    # the tokens of a row, over the sequence shards in the load-balanced order (``sequence_order``)
    ("activation_length", "sequence"),
    # the residual stream between blocks, its norms and elementwise work: split along the sequence over the
    # tensor group too (Megatron-style sequence parallelism); XLA gathers it before the attention and MLP
    # projections and reduce-scatters their outputs, where it would otherwise all-reduce them
    ("activation_residual_length", ("sequence", "tensor")),
    ("activation_kv_length", None),  # keys/values are gathered over the sequence axis for attention
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_head_dim", None),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("stages", "pipeline"),  # the pipeline schedule's stage dimension (staged layers, activations in flight)
    # the distributed optimizer (``optimizer.distributed``): the axes that split the batch's tokens, and so hold
    # the same sums of the weights' gradients, also split the optimizer state; each moment is cut over those its
    # parameter is not already cut over, on the dimension that takes them (``optimizer_spec``)
    ("optimizer_state", ("data", "fsdp", "sequence", "expert")),
)

# read-only: a test that tries another rule replaces the whole table (``logical_to_spec``'s cache follows it)
_RULES = types.MappingProxyType(dict(RULES))

BATCH_AXES = ("activation_batch", "activation_length")
# layout of a row's tokens over the shards of ``activation_length`` (see ``sequence_order``)
SEQUENCE_LAYOUT = "zigzag"


_specs: dict[tuple, PartitionSpec] = {}  # logical_to_spec's answers for the table ``_specs_of``
_specs_of: Mapping | None = None
_epoch = 0


def rules_epoch() -> int:
    """A number that changes whenever the rules table is replaced: what is remembered of its answers keys on it."""
    global _specs_of, _epoch
    if _specs_of is not _RULES:
        _specs.clear()
        _specs_of, _epoch = _RULES, _epoch + 1
    return _epoch


def logical_to_spec(names: Sequence[str | None]) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry the given logical names (remembered: the planner asks
    millions of times)."""
    rules_epoch()
    key = (tuple(names), AXES_TAKEN.get(), BATCH_OVER_STAGES.get())
    spec = _specs.get(key)
    if spec is None:
        spec = _specs[key] = _logical_to_spec(key[0])
    return spec


def _logical_to_spec(names: tuple[str | None, ...]) -> PartitionSpec:
    used: set[str] = set(AXES_TAKEN.get())
    spec = []
    for name in names:
        if name is None:
            spec.append(None)
            continue
        if name not in _RULES:
            raise KeyError(f"logical axis {name!r} has no rule in jaxtron.parallel.sharding.RULES")
        target = _RULES[name]
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        if name == "activation_batch" and BATCH_OVER_STAGES.get():
            axes += spec_axes(logical_to_spec(("stages",)), 0)
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def stage_axes() -> tuple[str, ...] | None:
    """The mesh axes the pipeline's stage dimension splits over (the ``spmd_axis_name`` of a vmap over the stages),
    None without a mesh or a pipeline axis."""
    if jax.sharding.get_abstract_mesh().empty:
        return None
    return spec_axes(logical_to_spec(("stages",)), 0) or None


@contextlib.contextmanager
def axes_taken(axes: Sequence[str]):
    """Within this context (while tracing the body of a vmap whose ``spmd_axis_name`` is ``axes``) no logical
    name maps onto these mesh axes: the vmapped dimension holds them."""
    with AXES_TAKEN.bound(tuple(AXES_TAKEN.get()) + tuple(axes)):
        yield


def replica_map(fn, axes: Sequence[str], in_axes: Any = 0):
    """``jax.vmap(fn, in_axes, spmd_axis_name=axes)``, traced with ``axes`` taken (``axes_taken``): the mapped
    dimension holds the replicas along those mesh axes (``replica_axes``), and the logical names inside ``fn`` map
    onto the others."""
    def call(*args):
        with axes_taken(axes):
            return jax.vmap(fn, in_axes=in_axes, spmd_axis_name=tuple(axes))(*args)
    return call


def spec_axes(spec: PartitionSpec, dim: int) -> tuple[str, ...]:
    """The mesh axes that shard dimension ``dim`` of an array with this spec (none, one or several).

    Code that must name mesh axes itself (the collectives inside a ``shard_map``) takes them from here, so the
    rules table stays the only place that maps logical names onto the mesh."""
    entry = spec[dim] if dim < len(spec) else None
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def shard_count(sizes: Mapping[str, int], logical: str) -> int:
    """Into how many pieces the rules table cuts the logical axis ``logical`` on a mesh of these axis sizes."""
    return math.prod(sizes.get(axis, 1) for axis in spec_axes(logical_to_spec((logical,)), 0))


def sequence_order(length: int, shards: int, layout: str = SEQUENCE_LAYOUT) -> np.ndarray:
    """Which token of a row each column of the global [batch, length] arrays holds, for a length cut into
    ``shards`` contiguous pieces (``activation_length``).

    'zigzag' balances causal attention: the row is cut into 2 x ``shards`` chunks and shard i holds chunks i and
    2 x shards - 1 - i, so every shard has as many early tokens (few keys to attend to) as late ones (many).
    'contiguous' (or one shard) is the identity. The loader lays its rows out in this order; the model needs no
    change, since attention takes causality from each token's position and document, not from its column.
    """
    if shards == 1 or layout == "contiguous":
        return np.arange(length)
    if layout != "zigzag" or length % (2 * shards):
        raise ValueError(f"cannot lay {length} tokens over {shards} shards as {layout!r}")
    chunks = np.arange(length).reshape(2 * shards, length // (2 * shards))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def constrain(x: jax.Array, layout: Sequence[Any] | PartitionSpec) -> jax.Array:
    """``x`` held in ``layout``: a PartitionSpec, or the logical names of its dimensions as the rules table maps
    them. A trailing ``...`` among the names leaves the remaining dimensions to XLA. A no-op without a mesh (one
    device, or code traced outside ``jax.set_mesh``), so that models call it on any mesh."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    if not isinstance(layout, PartitionSpec):
        names = tuple(layout)
        if names[-1:] == (...,):
            names = names[:-1]
            layout = PartitionSpec(*logical_to_spec(names), *(PartitionSpec.UNCONSTRAINED,) * (x.ndim - len(names)))
        else:
            layout = logical_to_spec(names)
    return jax.lax.with_sharding_constraint(x, layout)


def constrain_in_flight(tree: Any, hidden: Sequence[int], hidden_names: Sequence[str]) -> Any:
    """A pipeline schedule's activations in flight: hidden states [stages, ..., *hidden] and their per-token
    extras [stages, ..., rows, tokens], each held in full. The stage dimension goes over the pipeline, the rows and
    tokens as the stack's input (``hidden_names``; ``BATCH_AXES`` for the extras), the dimensions between whole.
    Other arrays are held on their stage dimension only. (Left to propagation, a schedule's buffers can come out
    whole over the batch's axes on every device, and so can what reads them.)"""
    hidden = tuple(hidden)

    def one(a):
        if a.shape[-len(hidden):] == hidden:
            return constrain(a, ("stages", *(None,) * (a.ndim - 1 - len(hidden)), *hidden_names))
        if a.ndim >= 3 and a.shape[-2:] == hidden[:2]:
            return constrain(a, ("stages", *(None,) * (a.ndim - 3), *BATCH_AXES))
        return constrain(a, ("stages", ...))
    return jax.tree.map(one, tree)


def replica_axes(params: Any, sizes: Mapping[str, int], whole: bool = False) -> tuple[str, ...]:
    """The mesh axes of the replicas on a mesh of ``sizes``: the leading axes of ``activation_batch`` (of more than
    one device) up to the first that also splits a parameter (with ``whole``, an expert's: the weights are
    ``whole_over_batch``). Devices along them hold the same weights and their own rows, so their weight gradients
    need no sum until the step's end (``training/step.py``, ``training/pipeline/replicas.py``)."""
    spec_of = (lambda v: whole_over_batch(logical_names(v))) if whole else (lambda v: logical_to_spec(logical_names(v)))
    used = {a for v in jax.tree.leaves(params, is_leaf=is_variable) if is_variable(v)
            for axes in spec_of(v) if axes is not None
            for a in ((axes,) if isinstance(axes, str) else axes)}
    out = []
    for axis in spec_axes(logical_to_spec(("activation_batch",)), 0):
        if sizes.get(axis, 1) == 1:
            continue
        if axis in used:
            break
        out.append(axis)
    return tuple(out)


def replica_spec(axes: Sequence[str], names: Sequence[str | None], ndim: int, staged: bool = False,
                 whole: bool = False) -> PartitionSpec:
    """The layout of a [replicas, ..., *names] array, or with ``staged`` a [stages, replicas, ..., *names] one. The
    stage dimension goes over the pipeline, the replicas' over the mesh axes ``axes`` (``replica_axes``), the last
    dimensions as their logical ``names`` map onto the other axes (with ``whole``: ``whole_over_batch``), and those
    between whole."""
    lead = 2 if staged else 1
    with axes_taken(axes):
        middle = (None,) * (ndim - lead - len(names))
        rest = PartitionSpec(*middle, *whole_over_batch(names)) if whole else logical_to_spec((*middle, *names))
    stage = (logical_to_spec(("stages",))[0],) if staged else ()
    return PartitionSpec(*stage, tuple(axes) or None, *rest)


def whole_over_batch(names: Sequence[str | None]) -> PartitionSpec:
    """The PartitionSpec of ``names`` with the axes that split the batch's rows left out of every dimension but an
    ``experts`` one: a weight gathered over fsdp, once for a whole pipeline schedule (``pipeline.fsdp_gather``)."""
    batch = set(spec_axes(logical_to_spec(("activation_batch",)), 0))
    spec = logical_to_spec(names)
    out = []
    for d, name in enumerate(names):
        axes = spec_axes(spec, d)
        if name != "experts":
            axes = tuple(a for a in axes if a not in batch)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def gathered_axes(names: Sequence[str | None], sizes: Mapping[str, int]) -> list[tuple[str, ...]]:
    """Per dimension of a weight with these logical names, the mesh axes (of more than one device) that a gather for
    use undoes: the batch's axes that split it, but on an ``experts`` dimension (``whole_over_batch``)."""
    spec, whole = logical_to_spec(names), whole_over_batch(names)
    return [tuple(a for a in spec_axes(spec, d) if a not in spec_axes(whole, d) and sizes.get(a, 1) > 1)
            for d in range(len(names))]


def is_variable(x: Any) -> bool:
    """Whether ``x`` is an nnx Variable (a leaf of the state trees these helpers map over)."""
    return isinstance(x, nnx.Variable)


def logical_names(variable: nnx.Variable) -> tuple[str | None, ...]:
    names = variable.get_metadata().get("out_sharding")
    return tuple(names) if names else (None,) * variable.get_value().ndim


def without_leading_axes(sharding: jax.sharding.Sharding, ndim: int, k: int) -> jax.sharding.Sharding:
    """The sharding of one slice ``a[i, j, ...]`` (``k`` leading indices) of an ``ndim``-dimensional array."""
    if not isinstance(sharding, NamedSharding):
        return sharding  # e.g. one device: the same for any shape
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[k:]))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a [batch, length] token array: batch over data/fsdp/expert, length over sequence."""
    return NamedSharding(mesh, logical_to_spec(BATCH_AXES))


def rows_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of an array of whole rows ([batch, ...]): its rows over data/fsdp/expert, the rest whole (a
    generation's prompts and completions)."""
    return NamedSharding(mesh, logical_to_spec(("activation_batch",)))


def split_over(mesh: Mesh, *axes) -> NamedSharding:
    """A sharding of ``mesh`` that splits each dimension over the mesh axes given for it (None: whole), as a custom
    partitioning rule hands them on (``ops/blockwise_fp8.py``)."""
    return NamedSharding(mesh, PartitionSpec(*axes))


def per_device_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a [mesh.size] array with one element on each device (per-device flags)."""
    return NamedSharding(mesh, PartitionSpec(mesh.axis_names))


def sharding_table(mesh: Mesh, params: Any) -> str:
    """The rules table and every parameter's shape, logical names, per-device shard and physical sharding."""
    lines = ["mesh: " + ", ".join(f"{a}={s}" for a, s in mesh.shape.items()), "", "rules (logical -> mesh):"]
    lines += [f"  {name:<22} -> {target}" for name, target in RULES]
    lines += ["", f"{'parameter':<28} {'shape':<22} {'logical':<44} {'per device':<22} physical"]
    total = per_device = 0
    for path, var in nnx.to_flat_state(params):
        names = logical_names(var)
        value = var.get_value()
        spec = logical_to_spec(names)
        shard = NamedSharding(mesh, spec).shard_shape(value.shape)
        total += math.prod(value.shape) * value.dtype.itemsize
        per_device += math.prod(shard) * value.dtype.itemsize
        key = ".".join(str(p) for p in path)
        lines.append(f"{key:<28} {tuple(value.shape)!s:<22} {names!s:<44} {shard!s:<22} {spec}")
    lines += ["", (f"parameters: {total / 2**20:.1f} MiB in all, {per_device / 2**20:.1f} MiB per device "
                  "(AdamW keeps two more copies of the same shape and sharding)")]
    return "\n".join(lines)
