"""The reference tables' large runs, as jaxtron would run them: the planner's estimate of each published layout,
its best mesh, and the published layout compiled for H100s (compile-only, no GPU) at full depth.

    python benchmarks/seeds_table.py                     # every row, compiled (a few minutes each)
    python benchmarks/seeds_table.py --rows gpt3 --no-compile

For each row the planner picks how to run the published mesh (``search.best_for_mesh``: the schedule, the pipeline
microbatches, the distributed optimizer), and that exact config is compiled for the row's GPU count of H100s
(``jaxtron.planning.dry_run.on_target_in_subprocess``). A compile that would take more than ``--compile-timeout``
seconds is done again at fewer layers a stage and scaled (the table says so). The planner's best mesh of the same GPU
count is listed beside it. Written to ``benchmarks/seeds_table.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GIB = 2.0**30
PEAK = 989.4e12  # H100 SXM dense bf16

# name -> (config, GPUs, the published mesh in jaxtron's axes, the published figure, where it comes from).
# Megatron carves expert parallelism out of data parallelism; jaxtron's expert axis splits the dense layers' rows too,
# so "EP8 on 256 with TP4 PP4" is expert=8 data=2 here, and DeepSeek-V3's EP64 over TP2 PP16 on 1024 (its expert
# group spans the tensor pairs) is pipeline=16 expert=64.
ROWS = {
    "gpt3": ("gpt3_175b", 128, dict(pipeline=8, data=4, tensor=4), 0.47,
             "47% MFU, Megatron-LM's GPT-3 175B TP4 PP8 on 128 H100s (the reference tables); 390 TFLOP/s per GPU"),
    "llama70b": ("llama3_70b", 64, dict(pipeline=4, data=2, sequence=2, tensor=4), None,
                 "TP4 PP4 CP2 (the reference tables give no figure for this layout)"),
    "llama405b": ("llama3_405b", 1024, dict(pipeline=8, data=8, sequence=2, tensor=8), 400e12 / PEAK,
                  "about 400 TFLOP/s per GPU, Megatron-LM's Llama-3.1 405B TP8 PP8 CP2"),
    "mixtral": ("mixtral_8x22b", 256, dict(pipeline=4, data=2, expert=8, tensor=4), None,
                "TP4 PP4 EP8 on 256 (no published figure for 8x22B; Megatron-Core's 8x7B runs at 468 TFLOP/s)"),
    "deepseek": ("deepseek_v3", 1024, dict(pipeline=16, expert=64), 338e12 / 1978.9e12,
                 "338 TFLOP/s per GPU in FP8 on 1024 H100s, Megatron-Core (TP2 PP16 EP64)"),
}


GB200_GPUS = 1024


def load(config: str, overrides: list[str] = ()):
    from jaxtron.config.loader import load_config

    return load_config(os.path.join(ROOT, "configs", f"{config}.py"), list(overrides))


def planned(name: str) -> dict:
    """The planner's view of a row: how it runs the published mesh, and its best mesh of the same GPU count."""
    from jaxtron.parallel.mesh import full_sizes
    from jaxtron.planning import search
    from jaxtron.planning.gpus import STACK_TENSOR_EFFICIENCY, gpu

    config, gpus, mesh, _, _ = ROWS[name]
    cfg, h100 = load(config), gpu("h100")
    sizes = full_sizes(mesh)
    start = time.perf_counter()
    published = search.best_for_mesh(cfg, sizes, h100)
    rows = search.plan(cfg, gpus, h100)
    best = next((r for r in rows if r.fits), rows[0])
    # the same layout if jaxtron's tensor parallelism cost what KempnerForge's does (benchmarks/plan_calibration.md)
    kempnerforge_tp = search.best_for_mesh(cfg, sizes, dataclasses.replace(
        h100, tensor_efficiency=STACK_TENSOR_EFFICIENCY["KempnerForge"]))
    # the same layout with each block's projections in 2 chunks beside the tensor collectives (models/tensor_chunks.py)
    chunked = search.best_for_mesh(load(config, [("execution.tensor_chunks", "2")]), sizes, h100)
    return dict(published=_row(published), best=_row(best), published_kf_tp=_row(kempnerforge_tp),
                published_chunks=_row(chunked), plan_s=time.perf_counter() - start)


def planned_on_gb200(name: str) -> dict:
    """The planner's best mesh for a row's model on ``GB200_GPUS`` GB200s (NVL72: 64 GPUs an NVLink domain)."""
    from jaxtron.planning import search
    from jaxtron.planning.gpus import gpu

    start = time.perf_counter()
    rows = search.plan(load(ROWS[name][0]), GB200_GPUS, gpu("gb200"))
    best = next((r for r in rows if r.fits), rows[0])
    return dict(best=_row(best), plan_s=time.perf_counter() - start)


def _row(row) -> dict:
    e = row.estimate
    return dict(mesh=e.mesh, fits=row.fits, schedule=e.schedule, virtual_stages=e.virtual_stages,
                microbatches=e.microbatches,
                pipeline_microbatches=e.pipeline_microbatches, distributed_optimizer=e.distributed_optimizer,
                identity_layers=e.identity_layers, memory_gib=e.memory_bytes / GIB, step_s=e.step_s, mfu=e.mfu,
                tokens_per_s=e.tokens_per_s, unseen_gib=e.unseen_on_target_bytes / GIB, attention=e.attention)


def as_run(name: str, plan: dict, layers: int | None = None):
    """The config the planner estimated for the published mesh (``layers``: fewer, for a reduced compile)."""
    from jaxtron.planning import search

    config = ROWS[name][0]
    p = plan["published"]
    cfg = search.with_mesh(load(config), {k: v for k, v in p["mesh"].items()})
    pipeline = dataclasses.replace(cfg.pipeline, schedule=p["schedule"], virtual_stages=p.get("virtual_stages", 1),
                                   microbatches=p["pipeline_microbatches"] or cfg.pipeline.microbatches)
    # the planner's pick on a split sequence: cuDNN by chunks where it prices them faster than the blockwise kernel
    attention = "cudnn" if p["attention"] == "cudnn" else cfg.execution.attention
    cfg = dataclasses.replace(
        cfg, pipeline=pipeline, train=dataclasses.replace(cfg.train, microbatches=p["microbatches"]),
        optimizer=dataclasses.replace(cfg.optimizer, distributed=p["distributed_optimizer"]),
        execution=dataclasses.replace(cfg.execution, attention=attention))
    if layers is not None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers))
    return cfg


def compiled(name: str, plan: dict, timeout_s: float) -> dict:
    """The published mesh's step compiled for its H100s at full depth; where that takes longer than ``timeout_s``,
    at two smaller depths of whole stages, the peak extrapolated linearly in the layers."""
    from jaxtron.planning.dry_run import on_target_in_subprocess
    from jaxtron.planning.estimate import estimate
    from jaxtron.planning.gpus import gpu

    _, gpus, _, _, _ = ROWS[name]
    cfg = as_run(name, plan)
    start = time.perf_counter()
    try:
        found = on_target_in_subprocess(cfg, "h100", gpus, timeout_s=timeout_s)
    except subprocess.TimeoutExpired:
        found = None
    if found is not None:
        est = estimate(cfg, found["mesh"], gpu("h100"))
        return dict(depth=cfg.model.num_layers, scaled=False, peak_gib=found["peak_bytes"] / GIB,
                    compile_s=time.perf_counter() - start, flops=found["flops"], kernels=found["kernels"],
                    budget_s=found["budget"]["seconds"],
                    estimated_gib=(est.memory_bytes - est.unseen_on_target_bytes) / GIB)
    stages = cfg.mesh.pipeline
    small = [stages * k + cfg.model.prefix_layers for k in (1, 2)]
    peaks = [on_target_in_subprocess(as_run(name, plan, n), "h100", gpus, timeout_s=timeout_s)["peak_bytes"]
             for n in small]
    slope = (peaks[1] - peaks[0]) / (small[1] - small[0])
    full = peaks[0] + slope * (cfg.model.num_layers - small[0])
    return dict(depth=small, scaled=True, peak_gib=full / GIB, compile_s=time.perf_counter() - start,
                peaks_gib=[p / GIB for p in peaks])


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--no-compile", action="store_true", help="the planner's columns only")
    parser.add_argument("--gb200-only", action="store_true",
                        help=f"re-plan the rows on {GB200_GPUS} GB200s only, keeping their H100 results")
    parser.add_argument("--compile-timeout", type=float, default=600.0)
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "seeds_table"))
    args = parser.parse_args()
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    if unknown:
        parser.error(f"unknown row {unknown[0]!r}; use some of {', '.join(ROWS)}")
    return args


def main() -> int:
    args = arguments()
    results, commits = {}, {}
    if os.path.exists(args.output + ".json"):  # rows not asked for keep their last results
        with open(args.output + ".json") as f:
            last = json.load(f)
        results, commits = last["rows"], last.get("commits", {"h100": last["commit"], "gb200": last["commit"]})
    for name in args.rows.split(","):
        if args.gb200_only and name in results:
            results[name]["gb200"] = planned_on_gb200(name)
            continue
        plan = planned(name)
        row = dict(plan=plan, gb200=planned_on_gb200(name))
        if not args.no_compile:
            row["compiled"] = compiled(name, plan, args.compile_timeout)
        results[name] = row
        print(name, json.dumps(row)[:400], flush=True)
    head = _commit()
    commits = {"h100": commits.get("h100", head) if args.gb200_only else head, "gb200": head}
    write(args.output, results, commits)
    return 0


def _mesh(sizes: dict) -> str:
    return " ".join(f"{a}={v}" for a, v in sizes.items() if v > 1)


def _how(p: dict) -> str:
    parts = [_mesh(p["mesh"])]
    if p["identity_layers"]:
        parts.append(f"+{p['identity_layers']} identity")
    if p["pipeline_microbatches"]:
        virtual = f" ({p['virtual_stages']} virtual stages)" if p.get("virtual_stages", 1) > 1 else ""
        parts.append(f"{p['schedule'].replace('_', '-')} x{p['pipeline_microbatches']}{virtual}")
    if p["microbatches"] > 1:
        parts.append(f"{p['microbatches']} accumulation microbatches")
    if p["attention"] == "cudnn" and p["mesh"].get("sequence", 1) > 1:
        parts.append("cuDNN by chunks")
    if p["distributed_optimizer"]:
        parts.append("dopt")
    return ", ".join(parts)


def _mfu(row: dict | None) -> str:
    return "—" if row is None else f"{100 * row['mfu']:.1f}%"


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                          check=False).stdout.strip()


def write(path: str, rows: dict, commits: dict[str, str]) -> None:
    """The JSON and the markdown tables; ``commits``: the commit of the H100 rows' and the GB200 rows' runs."""
    commit = commits["h100"]
    with open(path + ".json", "w") as f:
        json.dump(dict(commit=commit, commits=commits, rows=rows), f, indent=1)
    lines = [
        "# The reference tables' runs, planned and compiled for H100s",
        "",
        f"`python benchmarks/seeds_table.py` at commit {commit}: the planner's estimate of each published layout (how",
        "it would run it: schedule, pipeline microbatches, distributed optimizer), the step compiled for that many",
        "compile-only H100s (jax's CUDA plugin, no GPU; XLA's peak per device, which leaves out cuDNN's workspace),",
        "and the planner's best mesh of the same GPU count. MFU is model FLOPs over the dense bf16 peak (FP8's for",
        "DeepSeek-V3's published figure). The planner's constants are those fitted on KempnerForge's runs; its",
        "tensor parallelism costs the bytes of its collectives, not overlapped, with the GEMMs at their plain rate",
        "(Megatron's runs fit that, `benchmarks/plan_calibration.md`). Beside it, the published layout with",
        "`execution.tensor_chunks=2` (80% of the chunked parts' tensor collectives beside GEMMs, and the chunks'",
        "extra weight-gradient pass each microbatch), and were jaxtron's tensor parallelism to cost what",
        "KempnerForge's does, 30% of the GEMM rate besides. The compiled program's budget",
        "(`jaxtron/metrics/budget.py`: its kernels priced at the H200's measured ceilings, copies at the H100's",
        "bandwidth, collectives left out) and the MFU bound it sets beside it.",
        "",
        ("| run | GPUs | published | planner, published layout | est. MFU | est. MFU, 2 tensor chunks | "
         "est. MFU, KempnerForge's TP cost | est. GiB | compiled GiB | compiled budget s (MFU bound) | "
         "planner's best | its est. MFU |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        config, gpus, _, mfu, _ = ROWS[name]
        pub, best = row["plan"]["published"], row["plan"]["best"]
        c = row.get("compiled")
        if c is None:
            comp = "not compiled"
        elif c["scaled"]:
            comp = f"{c['peak_gib']:.1f} (from {c['depth'][0]} and {c['depth'][1]} layers)"
        else:
            comp = f"{c['peak_gib']:.1f} ({c['compile_s']:.0f} s)"
        budget = "—" if c is None or "budget_s" not in c else \
            f"{c['budget_s']:.1f} ({100 * pub['mfu'] * pub['step_s'] / c['budget_s']:.1f}%)"
        fits = "" if pub["fits"] else " (does not fit)"
        lines.append(f"| {config} | {gpus} | {f'{100 * mfu:.0f}%' if mfu else '—'} | {_how(pub)}{fits} | "
                     f"{100 * pub['mfu']:.1f}% | {_mfu(row['plan'].get('published_chunks'))} | "
                     f"{100 * row['plan']['published_kf_tp']['mfu']:.1f}% | "
                     f"{pub['memory_gib']:.1f} | {comp} | {budget} | {_how(best)} | "
                     f"{100 * best['mfu']:.1f}% |")
    lines += _gb200_table(rows, commits["gb200"])
    lines += ["", "Sources of the published figures:", ""]
    lines += [f"- {ROWS[name][0]}: {ROWS[name][4]}" for name in rows]
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def _gb200_table(rows: dict, commit: str) -> list[str]:
    """The rows re-planned on GB200s beside their H100 plans: the best mesh of each, its estimate and its tokens
    per second and GPU."""
    rows = {k: v for k, v in rows.items() if "gb200" in v}
    if not rows:
        return []
    lines = ["", f"## The same models planned on {GB200_GPUS} GB200s", "",
             f"`python benchmarks/seeds_table.py --gb200-only` at commit {commit}.",
             "The planner's best mesh on GB200 NVL72 racks (`planning/gpus.py`: 64 GPUs of each rack's 72 in one",
             "NVLink domain, NVLink 5 at 720 GB/s, a 400 Gb/s NIC a GPU between racks; the H100's fitted efficiencies",
             "on the GB200's datasheet peaks: no Blackwell run has measured them). MFU against the GB200's dense",
             "bf16 peak, 2500 TFLOP/s. An estimate, not a measurement.", "",
             ("| run | H100s: planner's best | est. MFU | tokens/s a GPU | GB200s: planner's best | est. MFU | "
              "step s | est. GiB | tokens/s a GPU | per GPU vs H100 |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        gpus = ROWS[name][1]
        h100, gb200 = row["plan"]["best"], row["gb200"]["best"]
        per_h100, per_gb200 = h100["tokens_per_s"] / gpus, gb200["tokens_per_s"] / GB200_GPUS
        lines.append(f"| {ROWS[name][0]} | {gpus}: {_how(h100)} | {100 * h100['mfu']:.1f}% | {per_h100:.0f} | "
                     f"{_how(gb200)} | {100 * gb200['mfu']:.1f}% | {gb200['step_s']:.2f} | "
                     f"{gb200['memory_gib']:.1f} | {per_gb200:.0f} | {per_gb200 / per_h100:.2f}x |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
