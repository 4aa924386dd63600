"""Summaries of a finished (or running) run from its files: metrics.jsonl, config.json, collectives.json, the
checkpoints folder and a profiler window.

Steady state (the rule ``summarize`` applies and states): a log interval is one metrics.jsonl line with a
``step_time_s``; it covers the steps since the previous such line. An interval counts unless
  (a) it is the first after a start or resume (its line carries ``compile_time_s``: first-step effects),
  (b) it ends within the first 10% of ``train.steps`` (warm-up: caches, allocator, loader read-ahead), or
  (c) it overlaps the profiler window (tracing slows the steps it records).
Sustained values are medians over the intervals that count.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import statistics
from typing import Any

from jaxtron.config.checks import jsonl_records
from jaxtron.config.loader import migrate
from jaxtron.config.schema import ConfigError, ExecutionConfig, ModelConfig
from jaxtron.metrics.bubble import idle_shares
from jaxtron.metrics.collectives import COLLECTIVES
from jaxtron.metrics.flops import fp8_flop_share

WARMUP_FRACTION = 0.1
SUSTAINED = ("step_time_s", "tokens_per_sec", "tflops_per_device", "mfu", "hfu", "data_wait_s", "data_wait_share")
RULE = ("medians over log intervals, leaving out the first interval after each start or resume, those ending in "
        f"the first {WARMUP_FRACTION:.0%} of train.steps, and those overlapping the profiler window")


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """The lines of ``workdir/metrics.jsonl``; a last line cut by a kill (no newline, not JSON) is left out with a
    warning, and anything else unreadable is a ConfigError naming the line."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"'{workdir}' has no metrics.jsonl; pass the --workdir of a jaxtron run.")
    records = []
    for number, record in jsonl_records(path, path, "the file is damaged", log_file=True):
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ConfigError(f"{path} line {number} has no integer 'step'; the file is damaged.")
        records.append(record)
    return records


def _json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        raise ConfigError(f"{path} is not readable JSON; the file is damaged.") from None


def intervals(records: list[dict[str, Any]]) -> list[tuple[int, int, dict[str, Any]]]:
    """(first step, last step, line) of each log interval, in order (``interval_steps`` gives its length)."""
    out, previous = [], 0
    for record in records:
        if "step_time_s" not in record:
            continue
        n = record.get("interval_steps")
        first = record["step"] - int(n) + 1 if isinstance(n, (int, float)) and n >= 1 else previous + 1
        out.append((first, record["step"], record))
        previous = record["step"]
    return out


def steady(records: list[dict[str, Any]], total_steps: int, window: tuple[int, int] | None) -> list[dict[str, Any]]:
    """The log lines whose intervals count for sustained values (module docstring)."""
    keep = []
    warmup_end = math.ceil(WARMUP_FRACTION * total_steps)
    for first, last, record in intervals(records):
        if "compile_time_s" in record or last <= warmup_end:
            continue
        if window and first <= window[1] and last > window[0]:  # steps window[0]+1 .. window[1] were traced
            continue
        keep.append(record)
    return keep


def median(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def checkpoint_steps(workdir: str) -> list[int]:
    folder = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(folder):
        return []
    return sorted(int(name) for name in os.listdir(folder) if name.isdigit())


_KIND = re.compile(r"(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)")


def _trace_events(profile_dir: str, window: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """The events of the profiler window's Perfetto trace; None without a complete window."""
    if not window or not window.get("trace"):
        return None
    path = os.path.join(profile_dir, window["trace"])
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            trace = json.load(f)
    except (OSError, json.JSONDecodeError, EOFError):
        raise ConfigError(f"the profiler trace {path} is not readable; the file is damaged.") from None
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def communication_share(window: dict[str, Any] | None, events: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """Share of device time in each kind of collective over the profiler window, from its Perfetto trace:
    the summed durations of the device ops of that kind divided by (window wall time x devices traced).
    Async collectives that overlap compute count in full, so this is the time collectives run, not the time
    they add to a step. None without a complete window."""
    if events is None:
        return None
    spans: dict[tuple, list[tuple[float, float]]] = {}  # (device, kind or 'any') -> [(start, end)] in seconds
    steps = set()
    for event in events:
        args = event.get("args") or {}
        if event.get("name") == "train" and "step_num" in args:
            steps.add(int(args["step_num"]))
        op = args.get("hlo_op")
        if op is None or event.get("ph") != "X":
            continue
        device = (event.get("pid"), args.get("device_ordinal"))
        span = (float(event["ts"]) / 1e6, (float(event["ts"]) + float(event.get("dur", 0.0))) / 1e6)
        spans.setdefault((device, "any"), []).append(span)
        match = _KIND.search(op)
        if match and "-done" not in op:  # an async pair is timed by its start op
            spans.setdefault((device, match.group(1)), []).append(span)
    devices = {device for device, _ in spans}
    denominator = window["wall_s"] * max(len(devices), 1)
    busy = {kind: sum(_covered(v) for (_, k), v in spans.items() if k == kind) / denominator
            for kind in COLLECTIVES + ("any",)}
    return {"steps": sorted(steps), "devices": max(len(devices), 1), "wall_s": window["wall_s"],
            "share": {k: busy[k] for k in COLLECTIVES}, "device_busy_share": busy["any"]}


def pipeline_idle(profile_dir: str, window: dict[str, Any] | None,
                  events: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """Each pipeline stage's measured idle share over the profiler window (``jaxtron.metrics.bubble``); None
    without a pipeline, a complete window, or iterations of the schedule's loops in the trace."""
    layout = _json(os.path.join(profile_dir, "pipeline.json"))
    return idle_shares(events, layout, window["wall_s"]) if layout and events else None


def _covered(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start, end) spans: ops that run at once on one device count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def skipped_steps(records: list[dict[str, Any]]) -> tuple[int | None, int | None]:
    """(steps skipped as non-finite, the step of the first log line that counts one) from the cumulative
    ``nonfinite_steps`` of the log lines; (None, None) when no line carries it."""
    counts = [(r["step"], r["nonfinite_steps"]) for r in records if isinstance(r.get("nonfinite_steps"), (int, float))]
    if not counts:
        return None, None
    first = next((step for step, n in counts if n > 0), None)
    return int(counts[-1][1]), first


def mfu_basis(config: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What the run's MFU is measured against: the dense peak of ``execution.dtype``, or with ``execution.fp8``
    the FLOP-weighted peak (see ``jaxtron.metrics.hardware.flop_weighted_peak``), with the FP8 share of the model
    FLOPs from config.json and the peak the logged TFLOP/s and MFU imply. None without a readable config."""
    try:
        config = migrate(config)  # a run of an older layout
        model = ModelConfig(**config["model"])
        execution = ExecutionConfig(**config.get("execution", {}))
        seq_len = int(config["data"]["seq_len"])
    except (KeyError, TypeError, ValueError, AttributeError):  # ConfigError is a ValueError
        return None
    share = fp8_flop_share(model, execution, seq_len)
    peak = next((r["tflops_per_device"] / r["mfu"] for r in records
                 if isinstance(r.get("mfu"), (int, float)) and r["mfu"] > 0
                 and isinstance(r.get("tflops_per_device"), (int, float))), None)
    if share:
        text = (f"FLOP-weighted dense peak: FP8 matmuls are {share:.1%} of the model FLOPs, counted at the fp8 peak, "
                f"the rest at the {execution.dtype} peak")
    else:
        text = f"dense {execution.dtype} datasheet peak"
    text += f" ({peak:.5g} TFLOP/s per device)" if peak else " (none known for this device: MFU is n/a)"
    return {"text": text, "fp8_flops_share": share, "peak_tflops": peak}


def summarize(workdir: str) -> dict[str, Any]:
    """Everything the report prints about one run."""
    records = read_metrics(workdir)
    config = _json(os.path.join(workdir, "config.json")) or {}
    total = (config.get("train") or {}).get("steps") or max((r["step"] for r in records), default=0)
    profile_cfg = config.get("profile") or {}
    profile_dir = profile_cfg.get("dir") or os.path.join(workdir, "profile")
    window_file = _json(os.path.join(profile_dir, "window.json"))
    window = (window_file["start_step"], window_file["end_step"]) if window_file else None
    events = _trace_events(profile_dir, window_file)
    counted = steady(records, total, window)
    train_lines = [r for r in records if "step_time_s" in r]
    evals = [r for r in records if isinstance(r.get("eval/loss"), (int, float))]
    out: dict[str, Any] = {
        "workdir": workdir, "rule": RULE, "steps_done": max((r["step"] for r in records), default=0),
        "train_steps": total, "intervals": len(train_lines), "steady_intervals": len(counted),
        "compile_time_s": next((r["compile_time_s"] for r in records if "compile_time_s" in r), None),
        "final_loss": next((r.get("loss_avg", r.get("loss")) for r in reversed(train_lines)), None),
        "final_validation_loss": evals[-1]["eval/loss"] if evals else None,
        "memory_peak_gib": max((r["memory_peak_gib"] for r in records if r.get("memory_peak_gib") is not None),
                               default=None),
        "checkpoints": checkpoint_steps(workdir),
        "collectives": _json(os.path.join(workdir, "collectives.json")),
        "communication": communication_share(window_file, events),
        "pipeline_idle": pipeline_idle(profile_dir, window_file, events),
    }
    for key in SUSTAINED:
        out[key] = median(counted, key)
    out["mfu_basis"] = mfu_basis(config, records)
    skipped, first = skipped_steps(records)
    out["nonfinite_steps"], out["nonfinite_first_step"] = skipped, first
    out["warnings"] = []
    if skipped:
        out["warnings"].append(f"{skipped} step(s) were skipped as non-finite (first logged at step {first}); "
                               "their updates were not applied")
    return out
