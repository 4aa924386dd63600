"""Collectives of a compiled XLA program, read from its HLO text: how many of each kind run per execution
and how many bytes they work on (per device: an all-gather's or all-reduce's result, a reduce-scatter's input),
with loop bodies counted once per iteration."""

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


_LISTED_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}")


def _group_size(line: str) -> int | None:
    """How many devices each group of the collective holds (replica groups listed, in iota form or over named
    mesh axes); None when the line says nothing of its groups."""
    listed = _LISTED_GROUPS.search(line)
    if listed:
        return len(listed.group(1).split(",")) if listed.group(1) else None
    iota = _IOTA_GROUPS.search(line)
    if iota:
        return int(iota.group(2))
    mesh = _MESH_GROUPS.search(line)
    if mesh:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes.get(a, 1)) for a in re.findall(r"'(\w+)'", mesh.group(2)))
    return None


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
    """Count and bytes of each collective kind executed per step in compiled HLO text: a collective in a loop
    body counts once per iteration (known trip counts), an async start/done pair once, one whose groups each hold
    a single device not at all. Bytes are the whole buffer a collective works on: the result of an all-gather,
    all-reduce, all-to-all or permute, the input of a reduce-scatter (its result times the group's size)."""
    out = {k: {"count": 0, "bytes": 0.0} for k in COLLECTIVES}
    comps, entry = _computations(hlo_text)
    runs = _multipliers(comps, entry) if entry else {}
    for name, lines in comps.items():
        times = runs.get(name, 0)
        for line in lines:
            kind = _kind(line)
            group = _group_size(line)
            if kind is None or "-done(" in line or not times or group == 1:
                continue
            out[kind]["count"] += times
            # a reduce-scatter's result is one part of what it reduces: count what it reduces, as for the others
            parts = (group or 1) if kind == "reduce-scatter" else 1
            out[kind]["bytes"] += times * _result_bytes(line) * parts
    return out
