"""Collectives of a compiled XLA program, read from its HLO text: how many of each kind run per execution
and how many bytes they work on (per device: an all-gather's or all-reduce's result, a reduce-scatter's input, a
ragged all-to-all's rows to send), with loop bodies counted once per iteration."""

from __future__ import annotations

import math
import re

from jaxtron.metrics.hlo import DTYPE_BYTES, SHAPE, definitions, runs_per_execution, type_bytes

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")


def _bytes(dtype: str, dims) -> int:
    return DTYPE_BYTES.get(dtype, 0) * math.prod(dims)


def _sent_bytes(line: str, defined: dict) -> int:
    """What a ragged all-to-all moves per device, bounded statically: its operand (all this device may send) or its
    output buffer (all it may receive), whichever is smaller. Dropless MoE sends every sorted row out (the operand)
    and brings back as many rows as it sent (the output), while its receive buffers are sized for the worst case."""
    shapes = [(dtype, [int(d) for d in dims.split(",") if d]) for dtype, dims in SHAPE.findall(line.split("=", 1)[1])]
    if "-start(" in line and len(shapes) >= 2:  # ((operand, output, offsets and sizes), result)
        return min(_bytes(*shapes[0]), _bytes(*shapes[1]))
    operand = re.search(r"ragged-all-to-all\((%[\w.\-]+)", line)
    result = _bytes(*shapes[0]) if shapes else 0
    if not operand or operand.group(1) not in defined:
        return result
    return min(result, _bytes(*defined[operand.group(1)]))


def _result_type(line: str) -> str:
    """The type text of a collective's HLO line: what stands between ``=`` and its opcode."""
    return re.split(rf" {_kind(line)}(?:-start)?\(", line.split("=", 1)[1], maxsplit=1)[0]


def _tuple_parts(text: str) -> list[str]:
    """The top-level elements of a tuple type ``(a, (b, c), d)``; a type that is no tuple is its one element."""
    text = re.sub(r"/\*.*?\*/", "", text).strip()
    if not text.startswith("("):
        return [text]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                parts.append(text[start:i])
                break
        elif ch == "," and depth == 1:
            parts.append(text[start:i])
            start = i + 1
    return [p.strip() for p in parts if p.strip()]


def _result_bytes(line: str) -> int:
    """Bytes of what one collective instruction line produces (a tuple result sums its parts); for the
    asynchronous start of a reduce-scatter, of what it reduces. The start of any kind but an all-reduce defines a
    tuple of its operands and its results (a permute's start may carry two scalar contexts after them)."""
    kind, text = _kind(line), _result_type(line)
    if kind and kind != "all-reduce" and f" {kind}-start(" in line:
        parts = _tuple_parts(text)
        if len(parts) > 1:
            text = parts[0] if kind == "reduce-scatter" else parts[1]
    return type_bytes(text)


_LISTED_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=(\S+))? \{([^}]*)\}")
_DEVICE_IDS = re.compile(r"\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)")


def group_devices(line: str) -> list[int] | None:
    """The devices of a collective's first replica group (listed, in iota form, or over named mesh axes laid out
    in order); None when the line says nothing of its groups."""
    listed = _LISTED_GROUPS.search(line)
    if listed:
        return [int(i) for i in listed.group(1).split(",") if i] or None
    iota = _IOTA_GROUPS.search(line)
    if iota:  # [groups, size]<=[dims] read in the order T(perm)
        size = int(iota.group(2))
        dims = [int(d) for d in iota.group(3).split(",")]
        perm = [int(p) for p in iota.group(4).split(",")] if iota.group(4) else list(range(len(dims)))
        return _strided(dims, perm)[:size]
    mesh = _MESH_GROUPS.search(line)
    if mesh:
        names = re.findall(r"'(\w+)'=(\d+)", mesh.group(1))
        over = set(re.findall(r"'(\w+)'", mesh.group(3)))
        dims = [int(size) for _, size in names]
        places = _strided(dims, [i for i, (axis, _) in enumerate(names) if axis in over])
        return sorted(_device_order(mesh.group(2), math.prod(dims))[p] for p in places)
    return None


def _device_order(device_ids: str | None, count: int) -> list[int]:
    """The device at each row-major place of a named mesh: ``device_ids=([dims]T(perm))`` lays them out as the iota
    of ``dims`` transposed by ``perm`` (XLA:GPU's pipelined layouts name their tensor groups so); without it, in
    order."""
    ids = _DEVICE_IDS.fullmatch(device_ids) if device_ids else None
    if not ids:
        return list(range(count))
    dims = [int(d) for d in ids.group(1).split(",")]
    perm = [int(p) for p in ids.group(2).split(",")] if ids.group(2) else list(range(len(dims)))
    return _strided(dims, perm)


def _strided(dims: list[int], axes: list[int]) -> list[int]:
    """The row-major positions in ``dims`` of the points along ``axes`` (others 0), ``axes[-1]`` fastest."""
    strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
    out = [0]
    for axis in axes:
        out = [i + k * strides[axis] for i in out for k in range(dims[axis])]
    return out


def group_size(line: str) -> int | None:
    """How many devices each group of the collective holds (``group_devices``); None when the line says nothing
    of its groups."""
    devices = group_devices(line)
    return len(devices) if devices else None


def _kind(line: str) -> str | None:
    for kind in COLLECTIVES:
        if f" {kind}(" in line or f" {kind}-start(" in line:
            return kind
    return None


def collective_bytes(line: str, defined: dict) -> int:
    """The bytes one collective instruction works on (``collectives`` says which for each kind); ``defined``:
    ``metrics.hlo.definitions`` of the program, where a ragged all-to-all's operand is read."""
    kind = _kind(line)
    if kind == "ragged-all-to-all":
        return _sent_bytes(line, defined)
    # a synchronous reduce-scatter's result is one part of what it reduces: count what it reduces, as for the others
    scattered = kind == "reduce-scatter" and f" {kind}-start(" not in line
    return _result_bytes(line) * ((group_size(line) or 1) if scattered else 1)


def collectives(hlo_text: str) -> dict[str, dict[str, float]]:
    """Count and bytes of each collective kind executed per step in compiled HLO text: a collective in a loop
    body counts once per iteration (known trip counts), an async start/done pair once, one whose groups each hold
    a single device not at all. Bytes are the whole buffer a collective works on: the result of an all-gather,
    all-reduce, all-to-all or permute, the input of a reduce-scatter (its result times the group's size); for a
    ragged all-to-all, whose sizes are known only when it runs, the smaller of its operand and its output."""
    out = {k: {"count": 0, "bytes": 0.0} for k in COLLECTIVES}
    comps, runs = runs_per_execution(hlo_text)
    defined = definitions(hlo_text) if "ragged-all-to-all" in hlo_text else {}
    for name, lines in comps.items():
        times = runs.get(name, 0)
        for line in lines:
            kind = _kind(line)
            group = group_size(line)
            if kind is None or "-done(" in line or not times or group == 1:
                continue
            out[kind]["count"] += times
            out[kind]["bytes"] += times * collective_bytes(line, defined)
    return out
