"""Summarise a run from its files, and compare two runs.

    jaxtron report WORKDIR                 # summary, and loss.png / throughput.png next to metrics.jsonl
    jaxtron report WORKDIR --vs OTHER      # the same numbers side by side, with OTHER / WORKDIR

Sustained values are medians over the steady-state log intervals (the rule is printed with them; see
``jaxtron.metrics.summary``). The communication share needs a profiler window
(``--config.profile.start_step=A --config.profile.end_step=B``); the collectives of the compiled step (count
and bytes) are always there. With a pipeline, the profiler window also gives each stage's measured idle share
(``jaxtron.metrics.bubble``).
"""

from __future__ import annotations

import argparse
from typing import Any

from jaxtron.common.files import user_path, write_json

ROWS = (  # (summary key, label, format)
    ("steps_done", "steps done", "{:d}"),
    ("compile_time_s", "compile time (s)", "{:.1f}"),
    ("step_time_s", "step time (s)", "{:.4g}"),
    ("tokens_per_sec", "tokens/s", "{:.4g}"),
    ("tflops_per_device", "TFLOP/s per device", "{:.4g}"),
    ("mfu", "MFU", "{:.1%}"),
    ("hfu", "HFU", "{:.1%}"),
    ("data_wait_share", "data wait (share of time)", "{:.2%}"),
    ("data_wait_s", "data wait per step (s)", "{:.3g}"),
    ("memory_peak_gib", "peak device memory (GiB)", "{:.2f}"),
    ("nonfinite_steps", "non-finite steps", "{:.0f}"),
    ("final_loss", "final train loss", "{:.4f}"),
    ("final_validation_loss", "final validation loss", "{:.4f}"),
)
MISSING = {"mfu": "n/a (no dense peak known for the device)", "hfu": "n/a (no dense peak known for the device)",
           "memory_peak_gib": "n/a (the backend does not report it)"}


def _value(summary: dict[str, Any], key: str, fmt: str) -> str:
    value = summary.get(key)
    if value is None:
        return MISSING.get(key, "n/a")
    return fmt.format(int(value) if fmt == "{:d}" else value)


def summary_text(s: dict[str, Any]) -> str:
    lines = [f"run {s['workdir']}: {s['steps_done']} of {s['train_steps']} steps",
             f"sustained values: {s['rule']} ({s['steady_intervals']} of {s['intervals']} intervals count)"]
    lines[1:1] = [f"WARNING: {warning}" for warning in s.get("warnings", [])]
    if not s["steady_intervals"]:
        lines.append("  no interval counts yet: train longer or log more often for sustained values")
    lines += [f"  {label:<28} {_value(s, key, fmt)}" for key, label, fmt in ROWS if key != "steps_done"]
    if s.get("mfu_basis"):
        lines.append(f"  {'MFU against the':<28} {s['mfu_basis']['text']}")
    lines.append(f"  {'checkpoints (steps)':<28} {', '.join(map(str, s['checkpoints'])) or 'none'}")
    if s["collectives"]:
        used = {k: v for k, v in s["collectives"].items() if v["count"]}
        text = ", ".join(f"{k} {v['count']:.0f} x, {v['bytes'] / 2**20:.1f} MiB" for k, v in used.items())
        lines.append(f"collectives of the compiled step, per step and device: {text or 'none'}")
    comm = s["communication"]
    if comm:
        share = ", ".join(f"{k} {v:.1%}" for k, v in comm["share"].items() if v) or "none ran"
        steps = comm["steps"]
        span = f"steps {steps[0]}-{steps[-1]}" if steps else "the window"
        lines.append(f"communication share over the profiler window ({span}, {comm['devices']} device(s), "
                     f"{comm['wall_s']:.2f} s): {share}; device ops busy {comm['device_busy_share']:.0%} of the time "
                     "(collectives overlapping compute count in full)")
    else:
        lines.append("communication share: no profiler window; run with --config.profile.start_step=A "
                     "--config.profile.end_step=B")
    idle = s.get("pipeline_idle")
    if idle:
        per_stage = ", ".join(f"stage {k} {loops:.1%} ({window:.1%})" for k, loops, window in
                              zip(idle["measured_stages"], idle["of_loops"], idle["of_window"], strict=True))
        lines.append(f"pipeline idle share per stage over the profiler window, of the schedule's loops (of the "
                     f"window's wall time): {per_stage}; the fill-drain formula gives {idle['formula']:.1%} of "
                     f"{idle['iterations']} iterations")
    return "\n".join(lines)


def compare(a: dict[str, Any], b: dict[str, Any]) -> str:
    width = max(len(a["workdir"]), len(b["workdir"]), 12)
    lines = [f"{'':<28} {a['workdir']:>{width}} {b['workdir']:>{width}} {'B / A':>8}"]
    for key, label, fmt in ROWS:
        va, vb = a.get(key), b.get(key)
        ratio = f"{vb / va:.3f}" if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else ""
        lines.append(f"{label:<28} {_value(a, key, fmt) if va is not None else 'n/a':>{width}} "
                     f"{_value(b, key, fmt) if vb is not None else 'n/a':>{width}} {ratio:>8}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`jaxtron report`: prints the summary of a run (or two side by side) and writes its plots."""
    parser = argparse.ArgumentParser(prog="jaxtron report", description=__doc__.split("\n")[0])
    parser.add_argument("workdir", help="the --workdir of a run")
    parser.add_argument("--vs", default=None, metavar="OTHER_WORKDIR", help="compare with this run")
    parser.add_argument("--no_plots", action="store_true", help="do not write PNG plots")
    parser.add_argument("--json", default=None, help="also write the summary (or both) to this file")
    args = parser.parse_args(argv)
    from jaxtron.metrics.summary import read_metrics, summarize

    runs = [summarize(user_path(args.workdir))] + ([summarize(user_path(args.vs))] if args.vs else [])
    for run in runs:
        print(summary_text(run))
        if not args.no_plots:
            from jaxtron.metrics.plots import write_plots
            paths = write_plots(read_metrics(run["workdir"]), run["workdir"], run["workdir"])
            print("plots: " + ", ".join(paths))
        print()
    if args.vs:
        print(compare(*runs))
    if args.json:
        write_json(args.json, runs if args.vs else runs[0])
    return 0

