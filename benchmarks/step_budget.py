"""The step's time budget of the GPU suite's MFU cases, compiled for a compile-only H200 (no GPU needed).

    python benchmarks/step_budget.py [--gpu h200] [--out benchmarks/step_budget] [--tree DIR] [--only NAME,...]

Each case and variant of ``benchmarks/gpu_suite.py`` (and the Llama-3 8B configs as a user runs them: no override but
the shape) is compiled by ``jaxtron plan --compile`` in a process of its own, from the source tree ``--tree`` (default:
this one; another checkout gives the budget of its program, read by this tree's ``jaxtron/metrics/budget.py``), and its
optimized HLO priced at the GPU's measured ceilings: GEMMs by precision, attention, memory-bound kernels, launches.
Writes ``OUT.json`` (every case's summary) and prints a markdown table; the MFU bound is the model FLOPs over the
budget against the dense bf16 peak (FP8 cases: the FLOP-weighted peak, as the train metrics report it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_suite import CASES, VARIANTS

from jaxtron.metrics.budget import CATEGORIES, CEILINGS, budget

_SHAPE = (("model.num_layers", "8"), ("data.seq_len", "4096"), ("train.global_batch_size", "4"))
# (name, config, overrides): the suite's cases, then the 8B configs with no override but the shape
USER_CASES = (("llama3_8b 8/32 layers bf16, as configured", "configs/llama3_8b.py", _SHAPE),
              ("llama3_8b 8/32 layers fp8, as configured", "configs/llama3_8b.py",
               (*_SHAPE, ("execution.fp8", "True"))))


def all_cases() -> list[tuple[str, str, tuple]]:
    return [(c.name, c.config, c.overrides) for c in CASES + VARIANTS] + list(USER_CASES)


def compile_case(tree: str, config: str, overrides, gpu: str, folder: str) -> dict:
    """Compiles one case with ``tree``'s ``jaxtron plan --compile`` for one ``gpu``; -> its dry run (JSON) and the
    path of its optimized HLO."""
    hlo, report = os.path.join(folder, "step.hlo"), os.path.join(folder, "plan.json")
    argv = [sys.executable, "-m", "jaxtron", "plan", f"--config={config}", "--gpus=1", f"--gpu={gpu}",
            "--compile=fsdp=1", f"--hlo={hlo}", f"--json={report}", "--top=1",
            *(f"--config.{k}={v}" for k, v in overrides)]
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if out.returncode != 0 or not os.path.exists(hlo):
        raise RuntimeError(f"the compile failed (exit {out.returncode}): {out.stderr.strip()[-400:]}")
    with open(report) as f:
        dry = json.load(f)["dry_run"]
    remat = re.search(r"remat (\w+)", out.stdout)
    chosen = re.search(r"best: .*? (full|none|save_dots_attention|save_dots|save_attention),", out.stdout)
    return {"dry_run": dry, "hlo": hlo, "remat": (chosen or remat).group(1) if (chosen or remat) else "?"}


def model_flops_and_peak(config: str, overrides, gpu: str) -> tuple[float, float]:
    """(model FLOPs of one step, the MFU denominator) of a case, as the train metrics count them."""
    from jaxtron.config.loader import load_config
    from jaxtron.metrics.flops import flops_per_token, fp8_flop_share
    from jaxtron.metrics.hardware import DENSE_PEAK_TFLOPS, weighted_peak

    cfg = load_config(os.path.join(REPO, config), list(overrides))
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    flops = flops_per_token(cfg.model, cfg.data.seq_len) * tokens
    peaks = DENSE_PEAK_TFLOPS[{"h200": "H200 SXM", "b200": "B200", "gb200": "GB200"}.get(gpu, "H100 SXM")]
    share = fp8_flop_share(cfg.model, cfg.execution, cfg.data.seq_len)
    low = "fp4" if cfg.execution.fp8_recipe == "nvfp4" else "fp8"  # NVFP4's GEMMs against the FP4 peak
    peak = weighted_peak(share, 1.0, peaks[low] * 1e12, peaks["bfloat16"] * 1e12) if share else \
        peaks["bfloat16"] * 1e12
    return flops, peak


def run(tree: str, gpu: str, names: list[str] | None) -> dict:
    rows = {}
    for name, config, overrides in all_cases():
        if names and not any(name.startswith(n) for n in names):
            continue
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder:
            try:
                got = compile_case(tree, config, overrides, gpu, folder)
            except RuntimeError as e:
                rows[name] = {"error": str(e)}
                print(f"{name}: {e}", file=sys.stderr)
                continue
            with open(got["hlo"]) as f:
                summary = budget(f.read(), CEILINGS[gpu]).summary()
        flops, peak = model_flops_and_peak(config, overrides, gpu)
        rows[name] = {"config": config, "overrides": [f"--config.{k}={v}" for k, v in overrides], "remat": got["remat"],
                      "peak_bytes": got["dry_run"]["compiled_peak"], "budget": summary, "model_flops": flops,
                      "mfu_peak": peak, "mfu_bound": flops / summary["seconds"] / peak}
        print(f"{name}: {1e3 * summary['seconds']:.1f} ms ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return rows


def markdown(rows: dict, before: dict | None = None) -> str:
    head = ["case", "remat", "peak GiB"] + [f"{c} ms" for c in CATEGORIES] + ["budget ms", "MFU bound"]
    if before:
        head += ["before ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error'][:120]} |" + " |" * (len(head) - 2))
            continue
        b = r["budget"]
        cells = [name, r["remat"], f"{r['peak_bytes'] / 2**30:.1f}"]
        cells += [f"{1e3 * b['by_category'][c]:.1f}" if b["by_category"][c] else "" for c in CATEGORIES]
        cells += [f"**{1e3 * b['seconds']:.1f}**", f"{100 * r['mfu_bound']:.1f}%"]
        if before:
            old = before.get(name, {}).get("budget")
            cells.append(f"{1e3 * old['seconds']:.1f}" if old else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/step_budget.py", description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", default="h200", choices=sorted(CEILINGS))
    parser.add_argument("--tree", default=REPO, help="the source tree whose program is compiled")
    parser.add_argument("--out", default=None, help="write OUT.json")
    parser.add_argument("--before", default=None, help="a JSON this script wrote earlier, for a 'before' column")
    parser.add_argument("--only", default=None, help="comma-separated case name prefixes")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",")] if args.only else None
    rows = run(os.path.abspath(args.tree), args.gpu, names)
    before = None
    if args.before:
        with open(args.before) as f:
            before = json.load(f)["cases"]
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"gpu": args.gpu, "tree": args.tree, "command": " ".join(["python", *sys.argv]),
                       "cases": rows}, f, indent=1)
    print(markdown(rows, before))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
