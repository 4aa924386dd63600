"""Device mesh construction with axes (pipeline, data, fsdp, sequence, expert, tensor).

Axes go outermost to innermost in MESH_AXES order. Across several nodes, each axis is split into an
inter-node part (outer) and an intra-node part (inner): the node count is spread over the outermost axes
first (pipeline, then data, fsdp, ...), so tensor- and expert-parallel groups stay inside a node (NVLink) and
only pipeline, data and fsdp traffic crosses the network.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Hashable, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxtron.config.schema import MESH_AXES, ConfigError


def full_sizes(sizes: dict[str, int]) -> dict[str, int]:
    """Every mesh axis's size, outermost first; an axis ``sizes`` leaves out has size 1."""
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ConfigError(f"mesh axes {sorted(unknown)} do not exist; use {', '.join(MESH_AXES)}.")
    return {a: sizes.get(a, 1) for a in MESH_AXES}


def split_over_nodes(sizes: dict[str, int], nodes: int) -> dict[str, int]:
    """How many nodes each axis spans: the node count spread over the outermost axes first."""
    sizes, left, across = full_sizes(sizes), nodes, {}
    for axis in MESH_AXES:
        across[axis] = math.gcd(sizes[axis], left)
        left //= across[axis]
    if left != 1:
        raise ConfigError(f"the mesh {sizes} cannot be laid over {nodes} nodes of equal parts; make the product of "
                          f"the outer axes (data, fsdp, ...) a multiple of {nodes}.")
    return across


def arrange(devices: Sequence, sizes: dict[str, int], node_of: Sequence[Hashable]) -> np.ndarray:
    """``devices`` as an array of the mesh's shape, node by node (``node_of[i]`` is device i's node)."""
    by_node: dict[Hashable, list] = {}
    for device, node in zip(devices, node_of, strict=True):
        by_node.setdefault(node, []).append(device)
    per_node = {len(g) for g in by_node.values()}
    if len(per_node) != 1:
        counts = ", ".join(f"{node}: {len(g)}" for node, g in by_node.items())
        raise ConfigError(f"nodes have different device counts ({counts}); give every node the same number.")
    sizes = full_sizes(sizes)
    across = split_over_nodes(sizes, len(by_node))
    inside = {a: sizes[a] // across[a] for a in MESH_AXES}
    grid = np.empty((len(by_node), per_node.pop()), dtype=object)
    for i, on_node in enumerate(by_node.values()):
        grid[i, :] = on_node
    n = len(MESH_AXES)
    grid = grid.reshape([across[a] for a in MESH_AXES] + [inside[a] for a in MESH_AXES])
    grid = grid.transpose([k for i in range(n) for k in (i, n + i)])  # (across_0, inside_0, across_1, ...)
    return grid.reshape([sizes[a] for a in MESH_AXES])


def node_names() -> list[str]:
    """The node (host name) of every process, by process index; every process must call this together."""
    if jax.process_count() == 1:
        return [socket.gethostname()]
    from jaxtron.parallel import coordination
    coordination.share(f"jaxtron/node/{jax.process_index()}", socket.gethostname())
    return [coordination.wait_for(f"jaxtron/node/{p}", 120_000) for p in range(jax.process_count())]


def make_mesh(sizes: dict[str, int], devices: Sequence[jax.Device] | None = None,
              node_of: Sequence[Hashable] | None = None) -> Mesh:
    """A mesh over ``devices`` (default: all) with every axis in Auto (compiler-propagated) mode.

    ``node_of`` names each device's node (default: all on one node, which keeps the device order).
    """
    devices = list(devices) if devices is not None else jax.devices()
    node_of = [0] * len(devices) if node_of is None else node_of
    return Mesh(arrange(devices, sizes, node_of), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def process_aware_mesh(sizes: dict[str, int], devices: Sequence[jax.Device]) -> Mesh:
    """The training mesh: devices grouped by the node their process runs on."""
    names = node_names()
    return make_mesh(sizes, devices, [names[d.process_index] for d in devices])
