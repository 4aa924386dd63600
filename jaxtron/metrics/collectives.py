"""Collectives of a compiled XLA program, read from its HLO text: how many of each kind run per execution
and how many bytes their results hold (per device), with loop bodies counted once per iteration."""

from __future__ import annotations

import math
import re

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "pred": 1, "s8": 1, "u8": 1,
                "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


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


_GROUPS = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}")


def _alone(line: str) -> bool:
    """Whether every group of the collective holds one device (the shard_map transpose sums over mesh axes of
    size 1): such a collective moves nothing."""
    groups = _GROUPS.search(line)
    if groups:
        return all("," not in g for g in re.findall(r"\{([\d,]*)\}", groups.group(1)))
    mesh = _MESH_GROUPS.search(line)
    if mesh:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes.get(a, 1)) for a in re.findall(r"'(\w+)'", mesh.group(2))) == 1
    return False


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
    a loop body counts once per iteration (known trip counts), an async start/done pair once, one whose groups
    each hold a single device not at all."""
    out = {k: {"count": 0, "bytes": 0.0} for k in COLLECTIVES}
    comps, entry = _computations(hlo_text)
    runs = _multipliers(comps, entry) if entry else {}
    for name, lines in comps.items():
        times = runs.get(name, 0)
        for line in lines:
            kind = _kind(line)
            if kind is None or "-done(" in line or not times or _alone(line):
                continue
            out[kind]["count"] += times
            out[kind]["bytes"] += times * _result_bytes(line)
    return out
