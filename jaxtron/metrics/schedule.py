"""XLA's latency-hiding scheduler told what each kernel and collective of the program costs.

XLA's GPU scheduler orders a program's kernels so that collectives run beside compute that does not depend on them.
Unless given a profile, it weighs them with fixed guesses: every collective takes 5000 units, a library call or
custom kernel (cuBLAS, cuDNN, a Pallas kernel) 1000, a fused kernel 1 or 1000 by its kind, whatever it moves or
computes. A GEMM fusion of 100 GFLOP then weighs as little as a cast, so the scheduler sees nothing worth placing
beside an exchange and leaves many of them exposed.

``compile_scheduled`` compiles a program once, prices every kernel of it with the step's time budget
(``jaxtron.metrics.budget``: GEMMs at the GPU's GEMM rate, the rest at its copy rate) and every collective at the
bandwidth of the links its devices share (``link_bandwidth``), and compiles it again with those costs as the
scheduler's profile (XLA's ``xla_gpu_pgle_profile_file_or_directory_path``: the profile-guided latency estimator
reads costs in microseconds by instruction name, and a compile of the same program names its instructions the
same). It keeps whichever of the two programs leaves its collectives less exposed by the same prices. On the H100
target the MoE programs then hide far more of their exchanges (``benchmarks/moe_overlap_budget.md``).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

from jaxtron.gpu import links
from jaxtron.metrics import budget as budget_lib
from jaxtron.metrics import overlap
from jaxtron.metrics.budget import _FREE, Ceilings
from jaxtron.metrics.collectives import _kind, collective_bytes, group_devices
from jaxtron.metrics.hlo_program import Program

PROFILE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"
# what starting a collective adds to its transfer: NCCL's launch and its first round trip, seconds
COLLECTIVE_LATENCY_S = 10e-6


@dataclasses.dataclass(frozen=True)
class Costs:
    """What the scheduler's profile prices a program with: one GPU's kernel rates, the bus bandwidths of NVLink
    inside a node and of the network per GPU between nodes (bytes/s), and how many devices a node holds."""
    ceilings: Ceilings
    nvlink_bandwidth: float
    network_bandwidth: float
    per_node: int


def for_gpu(name: str, per_node: int = links.GPUS_PER_NODE) -> Costs:
    """The costs of an HGX machine's GPU ``name`` ('h100', 'h200'; ``gpu/links.py``), ``per_node`` GPUs a node."""
    return Costs(budget_lib.CEILINGS[name], links.NVLINK_BANDWIDTH, links.NETWORK_BANDWIDTH, per_node)


def for_devices(devices: list[Any]) -> Costs | None:
    """The costs of the GPUs jax runs on (H100 or H200, nodes of each process's devices); None elsewhere."""
    device = devices[0]
    kind = getattr(device, "device_kind", "").lower()
    if device.platform != "gpu" or not any(name in kind for name in budget_lib.CEILINGS):
        return None
    name = next(name for name in budget_lib.CEILINGS if name in kind)
    per_node = sum(d.process_index == device.process_index for d in devices)
    return for_gpu(name, per_node)


def link_bandwidth(line: str, costs: Costs) -> float:
    """Bandwidth of a collective over its group (bytes/s): NVLink's inside a node. Across nodes, an all-to-all's
    rows leave each device through its own NIC (the network's per-GPU bandwidth); a ring collective drives a NIC
    for each of the group's devices in a node, up to NVLink's bandwidth (the planner's
    ``Collectives.group_bandwidth``)."""
    ids = group_devices(line)
    if not ids:
        return costs.network_bandwidth
    nodes = len({i // costs.per_node for i in ids})
    if nodes == 1:
        return costs.nvlink_bandwidth
    if _kind(line) in ("all-to-all", "ragged-all-to-all"):
        return costs.network_bandwidth
    return min(costs.nvlink_bandwidth, len(ids) // nodes * costs.network_bandwidth)


def profile(hlo_text: str | Program, costs: Costs) -> str:
    """The scheduler's profile of a compiled program (``ProfiledInstructionsProto`` as text): each kernel's
    budgeted seconds plus a launch, each loop or call the seconds of what it runs, each collective's start its
    bytes over its link's bandwidth plus ``COLLECTIVE_LATENCY_S``, all in microseconds. Empty when the program
    has no asynchronous collective (nothing to schedule around)."""
    program = hlo_text if isinstance(hlo_text, Program) else Program(hlo_text)
    priced = {k.name: k for k in budget_lib.kernels(program, costs.ceilings)}
    nested = overlap._nested_seconds(program, priced)
    lines, collectives = [], 0
    for _, runs, line, name, _, opcode, _ in program.instructions():
        seconds = None
        if name in priced:
            seconds = priced[name].seconds + costs.ceilings.launch_s
        elif opcode.endswith("-start") and _kind(line):
            collectives += 1
            seconds = collective_bytes(line, program.shapes) / link_bandwidth(line, costs) + COLLECTIVE_LATENCY_S
        elif opcode in _FREE and (callees := overlap._callees(line, opcode)):
            seconds = sum(nested.get(c, (0.0, 0))[0] for c in callees) / runs
        if seconds is not None:
            lines.append(f'costs {{ name: "{name.lstrip("%")}" cost_us: {seconds * 1e6:.3f} }}')
    return "\n".join(lines) + "\n" if collectives else ""


def start_links(hlo_text: str | Program, costs: Costs) -> dict[str, float]:
    """Each asynchronous collective's start (by name) -> the bandwidth of its links (``link_bandwidth``)."""
    program = hlo_text if isinstance(hlo_text, Program) else Program(hlo_text)
    return {name: link_bandwidth(line, costs) for _, _, line, name, _, opcode, _ in program.instructions()
            if opcode.endswith("-start")}


def exposed_seconds(hlo_text: str | Program, costs: Costs) -> float:
    """Seconds per step that the program's asynchronous collectives take beyond the kernels scheduled between their
    starts and dones (``jaxtron.metrics.overlap``), each at the bandwidth of its links: what the step waits for."""
    program = hlo_text if isinstance(hlo_text, Program) else Program(hlo_text)
    links = start_links(program, costs)
    total = 0.0
    for window in overlap.windows(program, costs.ceilings):
        bandwidth = links.get(window.name, costs.network_bandwidth)
        total += window.runs * window.bytes / bandwidth * (1 - window.hidden(bandwidth))
    return total


def compile_scheduled(lowered: Any, options: dict[str, object], costs: Costs | None) -> Any:
    """``lowered.compile(options)``; with ``costs``, compiled again with the first compile's ``profile`` as the
    latency-hiding scheduler's (when it has collectives to schedule), and of the two programs the one whose
    collectives leave the step less to wait for (``exposed_seconds``; the first on a tie). XLA's own weights
    serve some programs better: its 5000 units an exchange made it put several GEMMs beside each short exchange
    inside a node, where exact costs put just enough by its estimate and a little less by the budget's."""
    compiled = lowered.compile(compiler_options=options)
    first = Program(compiled.as_text()) if costs is not None else None
    text = profile(first, costs) if first is not None else ""
    if not text:
        return compiled
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "costs.pbtxt")
        with open(path, "w") as f:
            f.write(text)
        again = lowered.compile(compiler_options={**options, PROFILE_OPTION: path})
    return again if exposed_seconds(again.as_text(), costs) < exposed_seconds(first, costs) else compiled
