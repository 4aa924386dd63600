"""Dry run: lower and compile the real train step for one mesh with abstract inputs (no parameter memory),
then read XLA's memory analysis and the collectives of the compiled program.

The devices are whatever jax has: fake CPU devices (``--xla_force_host_platform_device_count``) stand in for
GPUs. XLA:CPU partitions the program like XLA:GPU does, but attention runs as the XLA implementation (no
cuDNN kernel), and the CPU backend's memory analysis and collective combining can differ from a GPU's.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import jax
import jax.numpy as jnp

from jaxtron.checkpoint import abstract_with_shardings
from jaxtron.config import Config
from jaxtron.mesh import make_mesh
from jaxtron.sharding import batch_sharding, per_device_sharding
from jaxtron.training import state as state_lib
from jaxtron.training.step import train_step

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "pred": 1, "s8": 1, "u8": 1,
                "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


@dataclasses.dataclass
class DryRun:
    mesh: dict[str, int]
    compile_s: float
    argument_bytes: int  # per device: parameters, optimizer state, batch
    output_bytes: int
    alias_bytes: int  # outputs written in place of donated inputs
    temp_bytes: int  # activations and working space
    collectives: dict[str, dict[str, float]]  # kind -> {"count", "bytes"} per step and device

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs not aliased to them + temporaries: what the device holds at the step's peak."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def _result_bytes(line: str) -> int:
    """Bytes of the result of one HLO instruction line (a tuple result sums its parts)."""
    head = line.split("=", 1)[1].split(")", 1)[0] if "=" in line else line
    head = head.split(" " + _kind(line), 1)[0] if _kind(line) else head
    total = 0
    for dtype, dims in _SHAPE.findall(head):
        size = _DTYPE_BYTES.get(dtype)
        if size is not None:
            total += size * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _kind(line: str) -> str | None:
    for kind in COLLECTIVES:
        if f" {kind}(" in line or f" {kind}-start(" in line:
            return kind
    return None


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(")
_CALLS = re.compile(r"(?:body|condition|calls|to_apply)=%?([\w.\-]+)|branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """{computation name: its instruction lines} and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        match = _COMPUTATION.match(line)
        if match and line.rstrip().endswith("{"):
            current = match.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def _multipliers(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
    """How many times each computation runs per execution: a while body runs its known trip count times."""
    runs = {entry: 1}
    stack = [entry]
    while stack:
        name = stack.pop()
        for line in comps.get(name, []):
            trips = _TRIPS.search(line)
            for one, several in _CALLS.findall(line):
                for callee in (c.strip().lstrip("%") for c in (one or several).split(",")):
                    if callee not in comps:
                        continue
                    times = runs[name] * (int(trips.group(1)) if trips and " while(" in line else 1)
                    if runs.get(callee, 0) < times:
                        runs[callee] = times
                        stack.append(callee)
    return runs


def collectives(hlo_text: str) -> dict[str, dict[str, float]]:
    """Count and result bytes of each collective kind executed per step in compiled HLO text: a collective in
    a loop body counts once per iteration (known trip counts), an async start/done pair once."""
    out = {k: {"count": 0, "bytes": 0.0} for k in COLLECTIVES}
    comps, entry = _computations(hlo_text)
    runs = _multipliers(comps, entry) if entry else {}
    for name, lines in comps.items():
        times = runs.get(name, 0)
        for line in lines:
            kind = _kind(line)
            if kind is None or "-done(" in line or not times:
                continue
            out[kind]["count"] += times
            out[kind]["bytes"] += times * _result_bytes(line)
    return out


def abstract_batch(cfg: Config, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    shape = (cfg.train.global_batch_size, cfg.data.seq_len)
    sharding = batch_sharding(mesh)
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding) for k in BATCH_KEYS}


def dry_run(cfg: Config, devices: list | None = None, implementation: str = "xla") -> DryRun:
    """Compiles ``cfg``'s train step on its mesh over ``devices`` (default: all) without allocating it."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = cfg.check_devices(len(devices))
    mesh = make_mesh(sizes, devices)
    with jax.set_mesh(mesh):
        setup = state_lib.setup(cfg, implementation)
        shardings = state_lib.state_shardings(mesh, setup.abstract_state)
        state = abstract_with_shardings(setup.abstract_state, shardings)
        votes = jax.ShapeDtypeStruct((mesh.size,), jnp.int32, sharding=per_device_sharding(mesh))
        batch = abstract_batch(cfg, mesh)
        step = jax.jit(lambda s, b, v: train_step(setup, s, b, v),
                       in_shardings=(shardings, batch_sharding(mesh), votes.sharding),
                       out_shardings=(shardings, None), donate_argnums=0)
        start = time.perf_counter()
        compiled = step.lower(state, batch, votes).compile()
        compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    return DryRun(mesh=dict(mesh.shape), compile_s=compile_s,
                  argument_bytes=int(memory.argument_size_in_bytes), output_bytes=int(memory.output_size_in_bytes),
                  alias_bytes=int(memory.alias_size_in_bytes), temp_bytes=int(memory.temp_size_in_bytes),
                  collectives=collectives(compiled.as_text()))


def describe(result: DryRun) -> str:
    gib = 2.0 ** 30
    lines = [f"mesh {', '.join(f'{k}={v}' for k, v in result.mesh.items())}: compiled in {result.compile_s:.1f} s",
             f"per device: arguments {result.argument_bytes / gib:.2f} GiB (parameters, optimizer state, batch), "
             f"temporaries {result.temp_bytes / gib:.2f} GiB, outputs {result.output_bytes / gib:.2f} GiB "
             f"({result.alias_bytes / gib:.2f} GiB in place of donated inputs); peak {result.peak_bytes / gib:.2f} GiB",
             "collectives per step and device (loop bodies counted once per iteration):"]
    for kind, c in result.collectives.items():
        if c["count"]:
            lines.append(f"  {kind:<20} {c['count']:>4}  {c['bytes'] / 2**20:10.1f} MiB")
    return "\n".join(lines)
