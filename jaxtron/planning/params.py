"""The model's parameters as the planner sees them: shapes, logical axis names, and the share one device holds."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import jax
from flax import nnx

from jaxtron.config.schema import MESH_AXES, ExecutionConfig, ModelConfig
from jaxtron.models import build_model
from jaxtron.models.lora import PROJECTIONS
from jaxtron.parallel.sharding import (
    gathered_axes,
    logical_names,
    logical_to_spec,
    rules_epoch,
    spec_axes,
    whole_over_batch,
)
from jaxtron.parallel.state_sharding import optimizer_spec

_PROJECTION_WEIGHTS = frozenset(attribute for attribute, *_ in PROJECTIONS.values())


@dataclasses.dataclass(frozen=True)
class Param:
    path: str  # e.g. 'moe_layers.mlp.wo' (a routed expert's), 'layers.attn.wq.weight' (a projection's)
    shape: tuple[int, ...]
    names: tuple[str | None, ...]

    @property
    def in_blocks(self) -> bool:
        """A stacked block parameter: of the periods a pipeline runs, or of the blocks outside it."""
        return bool(self.names) and self.names[0] in ("layers", "unstaged_layers")

    @property
    def projection(self) -> bool:
        """A block projection's weight (``models/projection.Projection``: FP8 in an FP8 block, gathered for use over
        fsdp); not a routed expert's, nor the prediction modules' input projection."""
        parts = self.path.rsplit(".", 2)
        return self.in_blocks and parts[-1] == "weight" and parts[-2] in _PROJECTION_WEIGHTS

    @property
    def staged(self) -> bool:
        """A parameter of the periods a pipeline schedule runs (each stage holds its own)."""
        return bool(self.names) and self.names[0] == "layers"

    def sharded_dims(self, axis: str) -> tuple[int, ...]:
        """The dimensions the mesh axis ``axis`` shards."""
        return tuple(i for i, axes in enumerate(logical_to_spec(self.names))
                     if axes == axis or (isinstance(axes, tuple) and axis in axes))

    def shard_elements(self, sizes: Mapping[str, int]) -> int:
        """Elements one device holds (ceil division, as jax pads uneven shards); gathered for use:
        ``gathered_elements``."""
        return _shard_elements(self, rules_epoch(), tuple(sorted(sizes.items())))

    def gathered_elements(self, sizes: Mapping[str, int], also: tuple[str, ...] = ()) -> int:
        """Elements one device holds of this parameter gathered for use: its split over the batch's axes undone on
        every dimension but an ``experts`` one (fsdp, and expert for the weights outside the experts:
        ``whole_over_batch``); ``also``: more mesh axes whose split is undone (e.g. 'pipeline')."""
        return _gathered_elements(self, rules_epoch(), tuple(sorted(sizes.items())), tuple(also))

    def gather_axes(self, sizes: Mapping[str, int]) -> tuple[str, ...]:
        """The mesh axes (of more than one device) this parameter is gathered over for use, in mesh order: the group
        its gathers and its gradients' reduce-scatters run over."""
        return _gather_axes(self, rules_epoch(), tuple(sorted(sizes.items())))

    def optimizer_elements(self, sizes: Mapping[str, int]) -> int:
        """Elements one device holds of each of this parameter's AdamW moments under the distributed optimizer
        (``jaxtron.parallel.state_sharding.optimizer_spec``)."""
        return _optimizer_elements(self, rules_epoch(), tuple(sorted(sizes.items())))


# remembered (for the rules table of ``epoch``): the search asks each parameter's shard on each mesh many times
# (every microbatch count, schedule, policy)
@functools.lru_cache(maxsize=1 << 16)
def _shard_elements(param: Param, epoch: int, sizes: tuple[tuple[str, int], ...]) -> int:
    return elements_per_device(param.shape, logical_to_spec(param.names), dict(sizes))


@functools.lru_cache(maxsize=1 << 16)
def _gathered_elements(param: Param, epoch: int, sizes: tuple[tuple[str, int], ...], also: tuple[str, ...]) -> int:
    return elements_per_device(param.shape, whole_over_batch(param.names), dict(sizes), also)


@functools.lru_cache(maxsize=1 << 16)
def _gather_axes(param: Param, epoch: int, sizes: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
    gathered = {a for axes in gathered_axes(param.names, dict(sizes)) for a in axes}
    return tuple(a for a in MESH_AXES if a in gathered)


@functools.lru_cache(maxsize=1 << 16)
def _optimizer_elements(param: Param, epoch: int, sizes: tuple[tuple[str, int], ...]) -> int:
    return elements_per_device(param.shape, optimizer_spec(param.names, param.shape, dict(sizes)), dict(sizes))


def elements_per_device(shape: Sequence[int], spec, sizes: Mapping[str, int], without: Sequence[str] = ()) -> int:
    """Elements one device holds of an array of ``shape`` laid out as the partition ``spec`` on the mesh ``sizes``
    (ceil division, as jax pads uneven shards); ``without``: mesh axes whose split is undone."""
    return math.prod(-(-dim // math.prod(sizes.get(a, 1) for a in spec_axes(spec, i) if a not in without))
                     for i, dim in enumerate(shape))


@functools.lru_cache(maxsize=8)
def parameters(model: ModelConfig) -> tuple[Param, ...]:
    """Shapes and logical names of the model's parameters (abstract: nothing is allocated)."""
    state = jax.eval_shape(lambda: nnx.split(build_model(model, ExecutionConfig(), 0, "xla"), nnx.Param)[1])
    return tuple(Param(".".join(map(str, path)), tuple(v.get_value().shape), logical_names(v))
                 for path, v in nnx.to_flat_state(state))


def state_elements(params: tuple[Param, ...], sizes: Mapping[str, int]) -> int:
    """Parameter elements one device holds: the float32 weights, each AdamW moment and the gradient have as many
    (the moments fewer under the distributed optimizer: ``optimizer_elements``)."""
    return sum(p.shard_elements(sizes) for p in params)


def optimizer_elements(params: tuple[Param, ...], sizes: Mapping[str, int], distributed: bool) -> int:
    """Elements one device holds of each AdamW moment (and, under the distributed optimizer, of the gradient
    accumulator, which is sharded like them)."""
    if not distributed:
        return state_elements(params, sizes)
    return sum(p.optimizer_elements(sizes) for p in params)
