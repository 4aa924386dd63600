"""Which collectives of a compiled GPU program run beside compute: for each asynchronous collective, the kernels
XLA scheduled between its start and its done, priced by the step's time budget (``jaxtron.metrics.budget``).

A GPU runs a collective's start on its own stream and waits for it at the done, so the kernels scheduled between
the two run while the bytes travel: a window with none leaves the collective exposed, one whose kernels take
longer than the transfer hides it. Windows are read in each computation's scheduled order (the optimized HLO of a
GPU program is scheduled); a loop or call scheduled inside a window brings all of its kernels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxtron.metrics.budget import Ceilings, kernels
from jaxtron.metrics.collectives import _kind, collective_bytes, group_devices
from jaxtron.metrics.hlo_program import LINE, NESTED, TO_APPLY, Program, operand_names, split_instruction

# the exchanges of MoE blocks: what travels with the rows (the all-to-alls of their counts are a few bytes)
EXCHANGES = ("all-to-all", "ragged-all-to-all")
ROW_BYTES = 64 * 1024  # an exchange smaller than this carries counts or offsets, not rows


@dataclasses.dataclass(frozen=True)
class Window:
    """One asynchronous collective: its kind and start instruction, bytes per run, how often it runs per step, and
    the budget's seconds of the kernels scheduled between its start and done (per run), the GEMMs among them, and
    the devices of its first replica group (empty where the line names none)."""
    kind: str
    name: str
    bytes: float
    runs: int
    compute_s: float
    gemms: int
    devices: tuple[int, ...] = ()

    def hidden(self, bandwidth: float) -> float:
        """The share of the transfer (at ``bandwidth`` bytes/s) the kernels in its window can hide, 0 to 1."""
        transfer = self.bytes / bandwidth
        return 1.0 if transfer <= 0 else min(1.0, self.compute_s / transfer)


def windows(hlo_text: str | Program, ceilings: Ceilings) -> list[Window]:
    """Every asynchronous collective of the program's kernel-level computations (its text, or the text already
    indexed), with its window's compute."""
    program = hlo_text if isinstance(hlo_text, Program) else Program(hlo_text)
    priced = {k.name: k for k in kernels(program, ceilings)}
    nested = _nested_seconds(program, priced)
    defined = program.shapes
    out = []
    open_: dict[str, list] = {}  # start name -> [kind, bytes, seconds, GEMMs]
    current = None
    for comp, runs, line, name, _, opcode, tail in program.instructions():
        if comp != current:  # a window closes in the computation it opened in
            current, open_ = comp, {}
        kind = _kind(line)
        if kind and opcode.endswith("-start"):
            open_[name] = [kind, collective_bytes(line, defined), 0.0, 0, tuple(group_devices(line) or ())]
            continue
        if opcode.endswith("-done"):
            start = next(iter(operand_names(tail)), "")
            if start in open_:
                kind, moved, seconds, gemms, devices = open_.pop(start)
                out.append(Window(kind, start, moved, runs, seconds, gemms, devices))
            continue
        if not open_:
            continue
        seconds, gemms = 0.0, 0
        if name in priced:
            seconds = priced[name].seconds
            gemms = priced[name].category != "memory-bound"
        for callee in _callees(line, opcode):
            callee_seconds, callee_gemms = nested.get(callee, (0.0, 0))
            seconds += callee_seconds / runs
            gemms += callee_gemms
        for window in open_.values():
            window[2] += seconds
            window[3] += gemms
    return out


def _callees(line: str, opcode: str) -> list[str]:
    names = []
    for one, several in NESTED.findall(line):
        names += [c.strip().lstrip("%") for c in (one or several).split(",")]
    if opcode == "call":
        names += [c.lstrip("%") for c in TO_APPLY.findall(line)]
    return names


def _nested_seconds(program: Program, priced: dict) -> dict[str, tuple[float, int]]:
    """Computation -> (seconds per step of the kernels in it and in what it calls, how many GEMM-class kernels)."""
    memo: dict[str, tuple[float, int]] = {}

    def total(comp: str, seen: frozenset = frozenset()) -> tuple[float, int]:
        if comp in memo:
            return memo[comp]
        seconds, gemms = 0.0, 0
        for line in program.comps.get(comp, []):
            m = LINE.match(line)
            if not m:
                continue
            name = m.group(1)
            if name in priced:
                k = priced[name]
                seconds += k.runs * k.seconds
                gemms += k.category != "memory-bound"
            for callee in _callees(line, split_instruction(m.group(2))[1]):
                if callee not in seen:
                    s, g = total(callee, seen | {comp})
                    seconds, gemms = seconds + s, gemms + g
        memo[comp] = (seconds, gemms)
        return memo[comp]

    return {comp: total(comp) for comp in program.comps}


def exchanges(found: list[Window]) -> list[Window]:
    """The windows of the all-to-alls that carry rows (MoE dispatch and combine, forward and backward)."""
    return [w for w in found if w.kind in EXCHANGES and w.bytes >= ROW_BYTES]


def summary(found: list[Window], bandwidth: float | Mapping[str, float]) -> dict:
    """Per collective kind: how many (per step) run beside GEMM or attention kernels, beside any compute, in all;
    their bytes, their transfer seconds at ``bandwidth`` (one for all, or each window's by its start's name) and
    the share of those the windows' kernels can hide. 'exchanges' is the same for the row-carrying all-to-alls
    alone."""
    def rate(w: Window) -> float:
        return bandwidth[w.name] if isinstance(bandwidth, Mapping) else bandwidth

    def one(windows: list[Window]) -> dict:
        transfer = sum(w.runs * w.bytes / rate(w) for w in windows)
        hidden = sum(w.runs * w.bytes / rate(w) * w.hidden(rate(w)) for w in windows)
        return {"count": sum(w.runs for w in windows), "beside_gemms": sum(w.runs for w in windows if w.gemms),
                "beside_compute": sum(w.runs for w in windows if w.compute_s > 0),
                "bytes": sum(w.runs * w.bytes for w in windows), "transfer_s": transfer,
                "hidden_share": hidden / transfer if transfer else 1.0}
    kinds = sorted({w.kind for w in found})
    out = {kind: one([w for w in found if w.kind == kind]) for kind in kinds}
    out["exchanges"] = one(exchanges(found))
    return out


def report(hlo_text: str, ceilings: Ceilings, bandwidths: dict[str, float]) -> dict:
    """``summary`` of the program's windows at each named bandwidth (NVLink's, the network's)."""
    found = windows(hlo_text, ceilings)
    return {name: {"bandwidth": bandwidth, **summary(found, bandwidth)} for name, bandwidth in bandwidths.items()}


def text(reported: dict, hidden_assumed: float | None = None) -> str:
    """``report`` as lines for ``jaxtron plan --compile``: each collective kind at the first bandwidth, the MoE
    exchanges at every one (with the share the planner takes as hidden, when given)."""
    first, *_ = reported
    bandwidth = reported[first]["bandwidth"]
    lines = [(f"collectives beside compute (kernels between start and done, at the budget's rates; transfers at "
              f"{first}'s {bandwidth / 1e9:.0f} GB/s):")]
    for kind, s in reported[first].items():
        if kind in ("bandwidth", "exchanges") or not s["count"]:
            continue
        lines.append(f"  {kind:<20}{s['beside_gemms']:>5} of {s['count']:<5} beside GEMMs, {s['beside_compute']:>5} "
                     f"beside any kernel; {s['bytes'] / 2**30:.2f} GiB, {100 * s['hidden_share']:.0f}% hidden")
    if reported[first]["exchanges"]["count"]:
        shares = ", ".join(f"{100 * r['exchanges']['hidden_share']:.0f}% at {name}'s {r['bandwidth'] / 1e9:.0f} GB/s"
                           for name, r in reported.items())
        assumed = f" (the planner takes {100 * hidden_assumed:.0f}% as hidden)" if hidden_assumed is not None else ""
        lines.append(f"  MoE exchanges of rows: {reported[first]['exchanges']['beside_gemms']} of "
                     f"{reported[first]['exchanges']['count']} beside GEMMs; hidden {shares}{assumed}")
    return "\n".join(lines)
