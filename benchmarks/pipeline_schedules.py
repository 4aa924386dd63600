"""The pipeline schedules' memory against their microbatch count: the default model's train step on pipeline=2 x
fsdp=4 (4 rows a microbatch, so the batch grows with the count), compiled on 8 fake CPU devices and for 8
compile-only H100s, each schedule at 8, 16, 32 and 64 microbatches; XLA's temporaries per device. The interleaved
schedule runs 2 virtual stages (the model's 4 layers as 4 chunks of one).

    python benchmarks/pipeline_schedules.py          # writes benchmarks/pipeline_schedules.md and .json
    python benchmarks/pipeline_schedules.py --only interleaved   # those rows again, the others kept from the JSON

The H100 compiles need jax's CUDA plugin (``python -m pip install -e ".[gpu-target]"``; without it those columns are
left out). Each compile runs in a process of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
COUNTS = (8, 16, 32, 64)
SCHEDULES = ("fill_drain", "1f1b", "interleaved")

_CPU = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
from jaxtron.config.loader import load_config
from jaxtron.planning.dry_run import dry_run
cfg = load_config(sys.argv[1], [tuple(a.split("=", 1)) for a in sys.argv[2:]])
r = dry_run(cfg)
print(json.dumps(dict(temp=r.temp_bytes, compile_s=r.compile_s)))
"""


def overrides(schedule: str, microbatches: int) -> list[str]:
    return ["mesh.pipeline=2", "mesh.fsdp=4", f"pipeline.schedule={schedule}",
            f"pipeline.microbatches={microbatches}", f"train.global_batch_size={4 * microbatches}",
            "execution.dtype=bfloat16"] + (["pipeline.virtual_stages=2"] if schedule == "interleaved" else [])


def cpu(schedule: str, microbatches: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CPU, os.path.join(ROOT, "configs", "default.py"),
                          *overrides(schedule, microbatches)], capture_output=True, text=True, timeout=900,
                         check=False, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def h100(schedule: str, microbatches: int) -> dict:
    from jaxtron.config.loader import load_config
    from jaxtron.config.schema import ConfigError
    from jaxtron.planning.dry_run import on_target_in_subprocess

    cfg = load_config(os.path.join(ROOT, "configs", "default.py"),
                      [tuple(o.split("=", 1)) for o in overrides(schedule, microbatches)])
    try:
        got = on_target_in_subprocess(cfg, "h100", 8)
    except ConfigError as e:
        return {"error": str(e)[:300]}
    return {"temp": got["temp_bytes"], "compile_s": got["compile_s"], "kernels": got["kernels"]}


def main() -> int:
    import argparse

    from jaxtron.gpu import target

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated schedules to compile again (the others from the JSON)")
    args = parser.parse_args()
    path = os.path.join(ROOT, "benchmarks", "pipeline_schedules.json")
    rows = {}
    if args.only and os.path.exists(path):
        with open(path) as f:
            rows = json.load(f)["rows"]
    for schedule in args.only.split(",") if args.only else SCHEDULES:
        for m in COUNTS:
            row = {"cpu": cpu(schedule, m)}
            if target.plugin_installed():
                row["h100"] = h100(schedule, m)
            rows[f"{schedule} {m}"] = row
            print(schedule, m, json.dumps(row), flush=True)
    rows = {f"{schedule} {m}": rows[f"{schedule} {m}"] for schedule in SCHEDULES for m in COUNTS
            if f"{schedule} {m}" in rows}
    mib = lambda r: f"{r['temp'] / 2**20:.1f}" if "temp" in r else r.get("error", "")
    lines = ["| schedule | microbatches | XLA:CPU temporaries MiB | H100 temporaries MiB |", "|---|---|---|---|"]
    for key, row in rows.items():
        schedule, m = key.split()
        lines.append(f"| {schedule} | {m} | {mib(row['cpu'])} | {mib(row['h100']) if 'h100' in row else 'n/a'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(ROOT, "benchmarks", "pipeline_schedules.md"), "w") as f:
        f.write(text)
    with open(path, "w") as f:
        json.dump({"command": "python benchmarks/pipeline_schedules.py", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
