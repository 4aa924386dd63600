"""Device mesh construction with axes (data, fsdp, sequence, expert, tensor)."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxtron.config import MESH_AXES, MeshConfig


def make_mesh(sizes: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over ``devices`` (default: all) with every axis in Auto (compiler-propagated) mode.

    Axes go outermost to innermost in MESH_AXES order, so tensor-parallel groups are neighbouring
    devices (inside a node) and data-parallel groups are the farthest apart.
    """
    shape = tuple(sizes[a] for a in MESH_AXES)
    if devices is None:
        return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_from_config(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(devices) if devices is not None else jax.devices()
    return make_mesh(cfg.resolve(len(devices)), devices)
