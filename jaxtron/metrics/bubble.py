"""The pipeline bubble as measured: each stage's idle share over a profiler window.

A stage is idle in the iterations of the schedule's loop where it holds no microbatch: the first ``s``
iterations of stage ``s`` (fill) and those after its ``M * V`` stage passes (drain). In one SPMD program it runs
its periods on zeros then, so the trace shows it busy; what makes those iterations idle is the schedule, and
what the trace measures is how long they took. The schedule's loops are the while ops named by
``jaxtron.training.pipeline.SCOPE``: the forward loop runs iterations 0..I-1, the backward loop (its
transpose) runs them in reverse. In the trace, the loop body's own ops run once per iteration, so the start of
the first of them marks the start of each iteration.

``layout`` (written by the train loop next to the trace as ``pipeline.json``): stages, microbatches,
virtual_stages, the instructions of the two loops' bodies, and the stage of each traced device.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

_WHILE = re.compile(r"%(while[.\w-]*) = .*?body=%([\w.-]+).*?op_name=\"([^\"]*)\"")
_COMPUTATION = re.compile(r"^%([\w.-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%([\w.-]+) = ")


def schedule_loops(hlo_text: str, scope: str) -> dict[str, list[str]]:
    """{"forward": ops, "backward": ops}: the instructions of the bodies of the schedule's two outermost loops
    in a compiled program's HLO text, in program order (loops nested in them, the periods' scans, have op names
    that go on past '/while')."""
    bodies, loops, current = {}, {}, None
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = bodies.setdefault(head.group(1), [])
            continue
        ins = _INSTRUCTION.match(line)
        if ins and current is not None:
            current.append(ins.group(1))
    for _, body, op_name in _WHILE.findall(hlo_text):
        if re.search(re.escape(scope) + r"\)*/while$", op_name):
            loops["backward" if "transpose(" in op_name else "forward"] = bodies.get(body, [])
    return loops


def stage_layout(mesh, schedule, loops: dict[str, list[str]]) -> dict[str, Any]:
    """What ``idle_shares`` needs besides the trace: the schedule, its loops, and the pipeline stage of each of
    this process's devices by the ordinal its trace events carry."""
    import jax

    stage_of = {}
    for index, device in np.ndenumerate(mesh.devices):
        if device.process_index == jax.process_index():
            stage_of[str(device.local_hardware_id if device.local_hardware_id is not None else device.id)] = \
                int(index[0])
    return {"stages": schedule.stages, "microbatches": schedule.microbatches,
            "virtual_stages": schedule.virtual_stages, "loops": loops, "stage_of_device": stage_of}


def _iterations(events: list[tuple[float, float, str]], body: list[str], count: int) -> list[tuple[float, float]]:
    """(start, end) of every iteration of every run of a loop, given one device's (start, end, op) events of
    the loop body's own ops: the first body op that the trace shows a multiple of ``count`` times marks where
    each iteration starts; the last iteration of a run ends with the last body op before the next run."""
    starts: dict[str, list[float]] = {}
    for start, _, op in events:
        starts.setdefault(op, []).append(start)
    marker = next((op for op in body if starts.get(op) and len(starts[op]) % count == 0), None)
    if marker is None:
        return []
    marks = sorted(starts[marker])
    spans = []
    for run in range(len(marks) // count):
        begin = marks[run * count:(run + 1) * count]
        limit = marks[(run + 1) * count] if (run + 1) * count < len(marks) else float("inf")
        last = max((e for s, e, _ in events if begin[-1] <= s < limit), default=begin[-1])
        spans += list(zip(begin, begin[1:] + [last]))
    return spans


def idle_shares(events: list[dict[str, Any]], layout: dict[str, Any], wall_s: float) -> dict[str, Any] | None:
    """Per stage: the share of the schedule's loop time spent in its fill and drain iterations, and that idle
    time as a share of the window's wall time; means over the stage's traced devices. None when the trace
    shows no iterations of the loops (a backend that runs a loop as one op, say)."""
    stages, m, v = layout["stages"], layout["microbatches"], layout["virtual_stages"]
    count = m * v + stages - 1
    owner = {op: direction for direction, body in layout["loops"].items() for op in body}
    ops: dict[tuple[str, str], list[tuple[float, float, str]]] = {}  # (device, loop) -> [(start, end, op)]
    for event in events:
        args = event.get("args") or {}
        op, device = args.get("hlo_op"), str(args.get("device_ordinal"))
        if op in owner and event.get("ph") == "X" and device in layout["stage_of_device"]:
            start = float(event["ts"]) / 1e6
            ops.setdefault((device, owner[op]), []).append((start, start + float(event.get("dur", 0.0)) / 1e6, op))
    per_stage: dict[int, list[tuple[float, float]]] = {}  # stage -> [(idle s, loop s)] per device
    for device, stage in layout["stage_of_device"].items():
        idle = total = 0.0
        for direction, body in layout["loops"].items():
            spans = _iterations(sorted(ops.get((device, direction), [])), body, count)
            for k, (a, b) in enumerate(spans):
                t = k % count if direction == "forward" else count - 1 - k % count  # backward: in reverse
                idle += (b - a) if (t < stage or t >= stage + m * v) else 0.0
                total += b - a
        if total:
            per_stage.setdefault(stage, []).append((idle, total))
    if not per_stage:
        return None
    measured = sorted(per_stage)
    return {"stages": stages, "iterations": count, "formula": (stages - 1) / count, "measured_stages": measured,
            "of_loops": [float(np.mean([i / t for i, t in per_stage[s]])) for s in measured],
            "of_window": [float(np.mean([i for i, _ in per_stage[s]])) / wall_s for s in measured]}
