"""The planner's step time against jaxtron's own step measured on a GPU: every one-GPU MFU row of a GPU run's JSON
files, estimated for that GPU with the same config and overrides (``jaxtron.planning.estimate``), and the error.

    python benchmarks/plan_vs_gpu.py benchmarks/gpu_h200_2026-11-26_run2.json benchmarks/gpt3_tp4_shard_h200.json

None of these runs was fitted on (the planner's constants come from the published runs, benchmarks/
plan_calibration.md): the table shows how far its estimate of jaxtron's own program is from what the GPU ran.

    python benchmarks/plan_vs_gpu.py --fit-fp8 [JSON ...]

fits ``GPU.fp8_speedup`` (how many times faster the FP8 projections' GEMMs run than 16-bit ones, quantization
included) on the runs measured in both precisions: the planner's ratio of the bf16 step to the FP8 step against the
measured ratio, by least squares of their logs, and prints each pair's error with the speedup fitted on the other
pairs (leave-one-out). The fitted value goes into ``jaxtron/planning/gpus.py`` by hand.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def measured_rows(path: str) -> list[dict]:
    """The MFU results of a GPU suite's JSON (its 'mfu: ...' steps) or of an mfu.py JSON (its 'results')."""
    with open(path) as f:
        data = json.load(f)
    if "steps" in data:
        return [dict(s["result"], name=s["name"].removeprefix("mfu: ")) for s in data["steps"]
                if s["name"].startswith("mfu: ") and s.get("status") == "ok"]
    return [dict(r, name=f"{os.path.basename(r['config'])} ({r['remat']})") for r in data["results"]]


def estimate_row(row: dict, device_kind: str, fp8_speedup: float | None = None) -> dict:
    from jaxtron.config.loader import load_config
    from jaxtron.planning.estimate import estimate
    from jaxtron.planning.gpus import gpu

    overrides = [tuple(o.removeprefix("--config.").split("=", 1)) for o in row.get("overrides", [])]
    overrides += [("execution.remat", row["remat"])] if row.get("remat") else []
    # a GPU run records its checkout's absolute path; the config is read from this checkout's configs/
    name = row["config"]
    if os.path.isabs(name):
        name = os.path.join("configs", os.path.basename(name))
    cfg = load_config(os.path.join(ROOT, name), overrides)
    sizes = dict(pipeline=1, data=1, fsdp=1, sequence=1, expert=1, tensor=1)
    card = gpu("h200" if "H200" in device_kind else "h100")
    if fp8_speedup is not None:
        card = dataclasses.replace(card, fp8_speedup=fp8_speedup)
    est = estimate(cfg, sizes, card)
    measured = row["step_time_median_s"]
    return dict(name=row["name"], measured_s=measured, estimated_s=est.step_s,
                error=est.step_s / measured - 1.0, measured_mfu=row.get("mfu"), estimated_mfu=est.mfu,
                dominant=max(est.time, key=est.time.get))


def fp8_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(16-bit run, FP8 run) for each FP8 run whose name is a 16-bit run's with ' fp8' (for ' bf16') after it."""
    by_name = {r["name"]: r for r in rows}
    pairs = []
    for name, row in by_name.items():
        if name.endswith(" fp8"):
            base = name.removesuffix(" fp8")
            twin = by_name.get(base + " bf16", by_name.get(base))
            if twin is not None:
                pairs.append((twin, row))
    return pairs


def speedup_errors(pairs: list[tuple[dict, dict]], device_kind: str, fp8_speedup: float) -> list[float]:
    """Per pair: log of the planner's bf16-to-FP8 step ratio over the measured one, with ``fp8_speedup``."""
    out = []
    for bf16, fp8 in pairs:
        estimated = (estimate_row(bf16, device_kind, fp8_speedup)["estimated_s"]
                     / estimate_row(fp8, device_kind, fp8_speedup)["estimated_s"])
        out.append(math.log(estimated / (bf16["step_time_median_s"] / fp8["step_time_median_s"])))
    return out


def fit_fp8_speedup(pairs: list[tuple[dict, dict]], device_kind: str) -> float:
    """The ``fp8_speedup`` in [1, 2.5] that minimises the squared ``speedup_errors`` (golden-section search: the
    error grows with the speedup on every pair, so the sum of squares has one minimum)."""
    def cost(x):
        return sum(e * e for e in speedup_errors(pairs, device_kind, x))

    lo, hi = 1.0, 2.5
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(30):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        lo, hi = (lo, b) if cost(a) < cost(b) else (a, hi)
    return round((lo + hi) / 2, 3)


def fit_main(paths: list[str]) -> int:
    rows, kind = [], ""
    for path in paths:
        rows += measured_rows(path)
        kind = kind or _device_kind(path)
    pairs = fp8_pairs(rows)
    if len(pairs) < 2:
        print(f"{len(pairs)} runs measured in both precisions: the fit needs two or more.", file=sys.stderr)
        return 2
    fitted = fit_fp8_speedup(pairs, kind)
    print(f"fp8_speedup fitted on all {len(pairs)} pairs: {fitted}\n")
    print("| run (one H200) | measured bf16 / FP8 step | estimated | error | held out: fitted on the others | "
          "estimated | error |")
    print("|---|---|---|---|---|---|---|")
    for i, (bf16, fp8) in enumerate(pairs):
        measured = bf16["step_time_median_s"] / fp8["step_time_median_s"]
        others = fit_fp8_speedup(pairs[:i] + pairs[i + 1:], kind)
        cells = []
        for speedup in (fitted, others):
            err = speedup_errors([(bf16, fp8)], kind, speedup)[0]
            cells.append(f"{measured * math.exp(err):.3f} | {100 * math.expm1(err):+.1f}%")
        print(f"| {fp8['name']} | {measured:.3f} | {cells[0]} | {others} | {cells[1]} |")
    return 0


def _device_kind(path: str) -> str:
    with open(path) as f:
        data = json.load(f)
    return (data.get("device") or data.get("device_kind") or
            next((s["result"].get("device_kind") for s in data.get("steps", []) if s["name"] == "environment"), ""))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--fit-fp8"]:
        return fit_main(argv[1:] or [os.path.join(ROOT, "benchmarks", "gpu_h200_2026-11-26_run2.json")])
    paths = argv or [os.path.join(ROOT, "benchmarks", "gpu_h200_2026-11-26_run2.json"),
                     os.path.join(ROOT, "benchmarks", "gpt3_tp4_shard_h200.json")]
    rows = []
    for path in paths:
        kind = _device_kind(path)
        rows += [estimate_row(r, kind) for r in measured_rows(path)]
    print("| run (one H200) | measured step s | planner's step s | error | measured MFU | planner's MFU | "
          "planner's largest term |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['measured_s']:.4f} | {r['estimated_s']:.4f} | {100 * r['error']:+.1f}% | "
              f"{100 * (r['measured_mfu'] or 0):.1f}% | {100 * r['estimated_mfu']:.1f}% | {r['dominant']} |")
    errors = sorted(abs(r["error"]) for r in rows)
    print(f"\n{len(rows)} runs: median |error| {100 * errors[len(errors) // 2]:.1f}%, largest {100 * errors[-1]:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
