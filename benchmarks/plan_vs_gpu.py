"""The planner's step time against jaxtron's own step measured on a GPU: every one-GPU MFU row of a GPU run's JSON
files, estimated for that GPU with the same config and overrides (``jaxtron.planning.estimate``), and the error.

    python benchmarks/plan_vs_gpu.py benchmarks/gpu_h200_2026-11-26_run2.json benchmarks/gpt3_tp4_shard_h200.json

None of these runs was fitted on (the planner's constants come from the published runs, benchmarks/
plan_calibration.md): the table shows how far its estimate of jaxtron's own program is from what the GPU ran.
"""

from __future__ import annotations

import json
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


def estimate_row(row: dict, device_kind: str) -> dict:
    from jaxtron.config.loader import load_config
    from jaxtron.planning.estimate import estimate
    from jaxtron.planning.gpus import gpu

    overrides = [tuple(o.removeprefix("--config.").split("=", 1)) for o in row.get("overrides", [])]
    overrides += [("execution.remat", row["remat"])] if row.get("remat") else []
    cfg = load_config(os.path.join(ROOT, row["config"]), overrides)
    sizes = dict(pipeline=1, data=1, fsdp=1, sequence=1, expert=1, tensor=1)
    card = gpu("h200" if "H200" in device_kind else "h100")
    est = estimate(cfg, sizes, card)
    measured = row["step_time_median_s"]
    return dict(name=row["name"], measured_s=measured, estimated_s=est.step_s,
                error=est.step_s / measured - 1.0, measured_mfu=row.get("mfu"), estimated_mfu=est.mfu,
                dominant=max(est.time, key=est.time.get))


def main(argv: list[str]) -> int:
    paths = argv or [os.path.join(ROOT, "benchmarks", "gpu_h200_2026-11-26_run2.json"),
                     os.path.join(ROOT, "benchmarks", "gpt3_tp4_shard_h200.json")]
    rows = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        kind = (data.get("device") or data.get("device_kind") or
                next((s["result"].get("device_kind") for s in data.get("steps", []) if s["name"] == "environment"),
                     ""))
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
