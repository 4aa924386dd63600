"""Where a run computes (``place``): the mesh of its config over the devices, the step's static setup, the state's
shardings and the attention; and the sharding table ``jaxtron train --print_sharding`` prints."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxtron import families
from jaxtron.config.schema import Config, ConfigError, replace
from jaxtron.ops.attention import resolve_implementation
from jaxtron.parallel.checks import check_devices
from jaxtron.parallel.mesh import make_mesh, process_aware_mesh
from jaxtron.parallel.sharding import shard_count, sharding_table
from jaxtron.training import state as state_lib


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a run computes: its mesh, the static parts of the step, the state's shardings and the attention."""

    cfg: Config  # the run's, with execution.remat='auto' resolved
    mesh: Any
    setup: state_lib.Setup
    shardings: state_lib.TrainState
    implementation: str


def place(cfg: Config, devices: list[jax.Device] | None = None, resolve_remat: Callable | None = None) -> Placement:
    """The mesh of ``cfg`` over ``devices`` (default: all), the step's setup and the state's shardings.
    ``resolve_remat(cfg, mesh sizes, devices)`` -> ``cfg`` with execution.remat='auto' resolved (the planner's
    ``jaxtron.planning.remat.resolve_for_devices``, which ``jaxtron train`` passes)."""
    families.get(cfg.model.family)  # an unknown family is one sentence, before any device work
    devices = list(devices) if devices is not None else jax.devices()
    sizes = check_devices(cfg, len(devices))
    if cfg.execution.remat == "auto":
        if resolve_remat is None:
            raise ConfigError("execution.remat='auto' is chosen by the planner, which this caller does not pass; run "
                              "it with `jaxtron train` or name a policy (full, save_dots, save_dots_attention, ...).")
        cfg = resolve_remat(cfg, sizes, devices)
    mesh = process_aware_mesh(sizes, devices) if jax.process_count() > 1 else make_mesh(sizes, devices)
    implementation = resolve_implementation(cfg.execution.attention, jnp.dtype(cfg.execution.dtype),
                                            cfg.model.qk_head_dim, shard_count(sizes, "activation_length"))
    with jax.set_mesh(mesh):
        setup = state_lib.setup(cfg, implementation, sizes)
        shardings = state_lib.state_shardings(mesh, setup.abstract_state, setup.distributed_optimizer)
    return Placement(cfg, mesh, setup, shardings, implementation)


def sharding_report(cfg: Config, devices: list[jax.Device] | None = None) -> str:
    """The rules table and every parameter's logical and physical sharding on the mesh of ``cfg``."""
    placement = place(replace(cfg, execution=replace(cfg.execution, remat="full")), devices)  # remat moves nothing
    with jax.set_mesh(placement.mesh):
        return sharding_table(placement.mesh, placement.setup.abstract_state.params)
