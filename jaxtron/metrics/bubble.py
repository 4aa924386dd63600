"""The pipeline bubble as measured: each stage's idle share over a profiler window.

A stage is idle in the iterations of the schedule's loop where it holds no microbatch: the first ``s``
iterations of stage ``s`` (fill) and those after its ``M * V`` stage passes (drain). In one SPMD program it runs
its periods on zeros then, so the trace shows it busy; what makes those iterations idle is the schedule, and
what the trace measures is how long they took. The schedule's loops are the while ops named by
``jaxtron.training.pipeline.fill_drain.SCOPE``: the forward loop runs iterations 0..I-1, the backward loop (its
transpose) runs them in reverse, each iteration as P steps of the loop (one per period of a stage's pass). In
the trace, the loop body's own ops run once per step, so the start of the first of them marks the start of each
step; P consecutive steps make an iteration (P: the loops' trip count over I, ``loop_steps`` in the layout).

``layout`` (written by the train loop next to the trace as ``pipeline.json``): stages, microbatches,
virtual_stages, the instructions of the two loops' bodies, and the stage of each traced device.

The 1F1B schedules (``jaxtron/training/pipeline/one_f_one_b.py``) run one loop of M V + V S + S - 2 iterations
(V = 1 for '1f1b', the virtual stages for 'interleaved'), each with a forward phase and a backward phase (its named
scopes).
Stage s's forward is idle where its unit t - s falls outside 0..MV-1 and its backward where t - (VS - 1) -
(S - 1 - s) does; the layout then also names the loop body's top-level instructions of each phase (``phases``),
whose trace events time the phases of every iteration.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from jaxtron.metrics.hlo import TRIPS
from jaxtron.parallel import timetable

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


def schedule_steps(hlo_text: str, scope: str) -> int | None:
    """The trip count of the schedule's forward loop in a compiled program's HLO text (None: not found)."""
    for line in hlo_text.splitlines():
        loop = _WHILE.search(line)
        trips = TRIPS.search(line)
        if loop and trips and re.search(re.escape(scope) + r"\)*/while$", loop.group(3)) \
                and "transpose(" not in loop.group(3):
            return int(trips.group(1))
    return None


def phase_ops(hlo_text: str, loop_body: list[str], phases: dict[str, str]) -> dict[str, list[str]]:
    """{phase: the instructions of ``loop_body`` (a loop body's, as ``schedule_loops`` gives them) whose op name
    lies in that phase's named scope}, for ``phases`` {phase: scope name}."""
    wanted = set(loop_body)
    out: dict[str, list[str]] = {phase: [] for phase in phases}
    for line in hlo_text.splitlines():
        ins = _INSTRUCTION.match(line)
        op_name = re.search(r'op_name="([^"]*)"', line)
        if not ins or ins.group(1) not in wanted or not op_name:
            continue
        for phase, scope in phases.items():
            if f"/{scope}/" in op_name.group(1) or op_name.group(1).endswith(f"/{scope}"):
                out[phase].append(ins.group(1))
    return out


def stage_layout(mesh, schedule, loops: dict[str, list[str]],
                 phases: dict[str, list[str]] | None = None, steps: int | None = None) -> dict[str, Any]:
    """What ``idle_shares`` needs besides the trace: the schedule, its loops (and for 1F1B, its phases'
    instructions), the fill-drain loop's trip count (``steps``) and the pipeline stage of each of this process's
    devices by the ordinal its trace events carry."""
    import jax

    stage_of = {}
    for index, device in np.ndenumerate(mesh.devices):
        if device.process_index == jax.process_index():
            stage_of[str(device.local_hardware_id if device.local_hardware_id is not None else device.id)] = \
                int(index[0])
    layout = {"stages": schedule.stages, "microbatches": schedule.microbatches,
              "virtual_stages": schedule.virtual_stages, "loops": loops, "stage_of_device": stage_of,
              "schedule": schedule.kind}
    if phases is not None:
        layout["phases"] = phases
    if steps is not None:
        layout["loop_steps"] = steps
    return layout


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
        spans += list(zip(begin, begin[1:] + [last], strict=True))
    return spans


def _one_f_one_b_idle(events: list[dict[str, Any]], layout: dict[str, Any]) -> dict[int, list[tuple[float, float]]]:
    """Per stage, per traced device: (idle s, loop s) of the 1F1B loop, from its phases' events (see the module
    docstring); each top-level instruction of a phase runs once an iteration."""
    stages, m, v = layout["stages"], layout["microbatches"], layout["virtual_stages"]
    count = timetable.iterations(stages, m, v)
    owner = {op: phase for phase, ops in layout["phases"].items() for op in ops}
    durations: dict[tuple[str, str], list[tuple[float, float]]] = {}  # (device, op) -> [(start, seconds)]
    for event in events:
        args = event.get("args") or {}
        op, device = args.get("hlo_op"), str(args.get("device_ordinal"))
        if op in owner and event.get("ph") == "X" and device in layout["stage_of_device"]:
            durations.setdefault((device, op), []).append((float(event["ts"]), float(event.get("dur", 0.0)) / 1e6))
    per_stage: dict[int, list[tuple[float, float]]] = {}
    for device, stage in layout["stage_of_device"].items():
        idle = total = 0.0
        for op, phase in owner.items():
            runs = sorted(durations.get((device, op), []))
            if not runs or len(runs) % count:
                continue  # not every iteration of the window's steps traced: left out
            for k, (_, seconds) in enumerate(runs):
                t = k % count
                unit = timetable.forward_unit(t, stage) if phase == "forward" else \
                    timetable.backward_unit(t, stage, stages, v)
                idle += seconds if not timetable.unit(unit, stages, m, v)[0] else 0.0
                total += seconds
        if total:
            per_stage.setdefault(stage, []).append((idle, total))
    return per_stage


def idle_shares(events: list[dict[str, Any]], layout: dict[str, Any], wall_s: float) -> dict[str, Any] | None:
    """Per stage: the share of the schedule's loop time spent in its fill and drain iterations (for 1F1B: in the
    phases that hold no microbatch), and that idle time as a share of the window's wall time; means over the
    stage's traced devices. None when the trace shows no iterations of the loops (a backend that runs a loop as
    one op, say)."""
    stages, m, v = layout["stages"], layout["microbatches"], layout["virtual_stages"]
    if layout.get("schedule") in ("1f1b", "interleaved") and layout.get("phases"):
        per_stage = _one_f_one_b_idle(events, layout)
        if not per_stage:
            return None
        measured = sorted(per_stage)
        return {"stages": stages, "iterations": timetable.iterations(stages, m, v),
                "formula": (stages - 1) / (m * v + stages - 1),
                "measured_stages": measured,
                "of_loops": [float(np.mean([i / t for i, t in per_stage[s]])) for s in measured],
                "of_window": [float(np.mean([i for i, _ in per_stage[s]])) / wall_s for s in measured]}
    count = m * v + stages - 1
    per = max(1, int(layout.get("loop_steps") or count) // count)  # loop steps per iteration
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
            steps = _iterations(sorted(ops.get((device, direction), [])), body, count * per)
            spans = [(steps[k][0], steps[k + per - 1][1]) for k in range(0, len(steps) - per + 1, per)]
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
