"""Digests of the lowered train step for meshes and schedules that cover the sharding code's paths.

A change that only renames or moves code must leave every program byte-identical. Run before and after it:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python scripts/step_digests.py [--out DIR]

Each line is a case, the sha256 of its StableHLO text (no debug locations) and the text's length; ``--out``
also writes each text, for a diff. Lowering needs no compile: all nine cases take about 20 s on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import jax
import jax.numpy as jnp

from jaxtron.checkpoint.train_state import abstract_with_shardings
from jaxtron.config.loader import config_of
from jaxtron.parallel.checks import check_devices
from jaxtron.parallel.mesh import make_mesh
from jaxtron.parallel.sharding import batch_sharding, per_device_sharding
from jaxtron.planning.dry_run import abstract_batch
from jaxtron.planning.remat import resolve_for_devices
from jaxtron.training import state as state_lib
from jaxtron.training.step import train_step

PIPELINE = ["--config.mesh.pipeline=2", "--config.mesh.data=2", "--config.mesh.fsdp=2",
            "--config.pipeline.microbatches=4"]
EXPERTS = ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.expert=2"]
# name -> (shipped config, overrides): each reaches a path of its own through parallel/ and training/
CASES = {
    "fsdp_tensor_distributed": ("default", ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
                                            "--config.optimizer.distributed=True", "--config.train.microbatches=2"]),
    "replicas_accumulating": ("default", ["--config.mesh.data=4", "--config.mesh.fsdp=2",
                                          "--config.train.microbatches=2"]),
    "fill_drain": ("default", PIPELINE),
    "1f1b_distributed": ("default", [*PIPELINE, "--config.pipeline.schedule=1f1b",
                                     "--config.optimizer.distributed=True"]),
    "1f1b_gathered_once": ("default", [*PIPELINE, "--config.pipeline.schedule=1f1b",
                                       "--config.pipeline.fsdp_gather=step"]),
    "muon": ("default", ["--config.mesh.data=2", "--config.mesh.fsdp=4", "--config.optimizer.name=muon"]),
    "mixtral_experts": ("mixtral_tiny", EXPERTS),
    "deepseek_experts": ("deepseek_tiny", EXPERTS),
    "deepseek_pipeline": ("deepseek_tiny", ["--config.mesh.pipeline=2", "--config.mesh.data=2",
                                            "--config.mesh.expert=2", "--config.pipeline.microbatches=2",
                                            "--config.pipeline.uneven_stages=True"]),
}


def lowered_text(config: str, overrides: list[str]) -> str:
    """The StableHLO of the config's train step over all devices jax has, with XLA's attention."""
    cfg = config_of(config, overrides)
    devices = jax.devices()
    sizes = check_devices(cfg, len(devices))
    cfg = resolve_for_devices(cfg, sizes, devices)
    mesh = make_mesh(sizes, devices)
    with jax.set_mesh(mesh):
        setup = state_lib.setup(cfg, "xla", sizes)
        shardings = state_lib.state_shardings(mesh, setup.abstract_state, setup.distributed_optimizer)
        state = abstract_with_shardings(setup.abstract_state, shardings)
        votes = jax.ShapeDtypeStruct((mesh.size,), jnp.int32, sharding=per_device_sharding(mesh))
        step = jax.jit(lambda s, b, v: train_step(setup, s, b, v),
                       in_shardings=(shardings, batch_sharding(mesh), votes.sharding), out_shardings=(shardings, None),
                       donate_argnums=0)
        return step.lower(state, abstract_batch(cfg, mesh), votes).as_text()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="a folder to write each case's StableHLO text into")
    args = parser.parse_args()
    if len(jax.devices()) != 8:
        print("error: run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (8 devices).", file=sys.stderr)
        return 2
    for name, (config, overrides) in CASES.items():
        text = lowered_text(config, overrides)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"{name}.mlir"), "w") as f:
                f.write(text)
        print(f"{name:26s} {hashlib.sha256(text.encode()).hexdigest()[:16]} {len(text)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
