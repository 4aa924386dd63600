"""Muon against AdamW in the compiled program and in the planner: Llama-3 8B (32 layers, remat full) on 8 compile-only
GPUs, on three meshes, each step compiled with each optimizer.

    python benchmarks/muon_plan.py                 # writes benchmarks/muon_plan.md and .json (about 5 minutes)
    python benchmarks/muon_plan.py --gpu h200

Per device and step: the Newton-Schulz GEMMs' FLOPs (the step budget's float32 GEMMs; for bfloat16 iterations, the
bf16 GEMM FLOPs beyond the float32 program's) and the all-to-alls' bytes beyond AdamW's, each beside the planner's
(``jaxtron/planning/muon.py``); the peaks beside the planner's; the step budgets (``jaxtron/metrics/budget.py``) and
Muon's share over AdamW's. Needs jax's CUDA plugin (``python -m pip install -e ".[gpu-target]"``).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import results

BASE = ["model.num_layers=32", "execution.remat=full"]
MESHES = {"fsdp=8": dict(fsdp=8), "fsdp=4 tensor=2": dict(fsdp=4, tensor=2), "data=2 fsdp=4": dict(data=2, fsdp=4)}
VARIANTS = {"adamw": ["optimizer.name=adamw"], "muon": ["optimizer.name=muon"],
            "muon bf16": ["optimizer.name=muon", "optimizer.muon_dtype=bfloat16"]}


def _config(mesh: dict, variant: str):
    from jaxtron.config.loader import load_config

    sizes = [f"mesh.{axis}={mesh.get(axis, 1)}" for axis in ("data", "fsdp", "tensor")]
    overrides = [*BASE, *VARIANTS[variant], *sizes]
    return load_config(os.path.join(ROOT, "configs", "llama3_8b.py"), [tuple(o.split("=", 1)) for o in overrides])


def measure(gpu: str, mesh_name: str, variants: list[str]) -> list[dict]:
    from jaxtron.planning import muon
    from jaxtron.planning.dry_run import on_target_in_subprocess
    from jaxtron.planning.estimate import estimate
    from jaxtron.planning.gpus import GPUS
    from jaxtron.planning.params import parameters

    mesh, rows = MESHES[mesh_name], []
    for variant in variants:
        cfg = _config(mesh, variant)
        got = on_target_in_subprocess(cfg, gpu, 8)
        planned = estimate(cfg, mesh, GPUS[gpu])
        budget = got["budget"]
        rows.append(dict(
            mesh=mesh_name, variant=variant, peak_gib=got["peak_bytes"] / 2**30,
            planned_gib=planned.memory_bytes / 2**30, budget_ms=budget["seconds"] * 1e3,
            gemm_flops=budget["flops"], all_to_all_gib=got["collectives"]["all-to-all"]["bytes"] / 2**30,
            all_gather_gib=got["collectives"]["all-gather"]["bytes"] / 2**30,
            planned_all_to_all_gib=planned.collectives["all-to-all"] / 2**30,
            planned_ns_tflop=muon.newton_schulz_step_flops(cfg, parameters(cfg.model), mesh) / 1e12,
            planned_optimizer_ms=planned.time["optimizer"] * 1e3,
            planned_optimizer_comm_ms=planned.time["optimizer_comm"] * 1e3, planned_step_s=planned.step_s))
        print(mesh_name, variant, f"{rows[-1]['budget_ms']:.1f} ms", flush=True)
    adamw, f32 = rows[0], rows[1]
    for r in rows[1:]:  # what Muon adds to AdamW's program
        r["moved_gib"] = r["all_to_all_gib"] - adamw["all_to_all_gib"]
        extra_bf16 = r["gemm_flops"]["GEMM bf16"] - f32["gemm_flops"]["GEMM bf16"]
        r["ns_tflop"] = (r["gemm_flops"]["GEMM f32"] + extra_bf16) / 1e12
        r["overhead"] = r["budget_ms"] / adamw["budget_ms"] - 1
        r["planned_overhead"] = r["planned_step_s"] / adamw["planned_step_s"] - 1
    return rows


def table(rows: list[dict], gpu: str, command: str) -> str:
    lines = [f"# Muon against AdamW: Llama-3 8B (32 layers, remat full) on 8 {gpu.upper()}s, compiled and planned", "",
             f"`{command}`", "",
             ("| mesh | optimizer | peak GiB (planner) | Newton-Schulz TFLOP (planner) | all-to-all GiB beyond AdamW "
              "(planner) | all-gather GiB | budget ms | over AdamW (planner) |"),
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        muon = r["variant"] != "adamw"
        lines.append(
            f"| {r['mesh']} | {r['variant']} | {r['peak_gib']:.1f} ({r['planned_gib']:.1f}) | "
            + (f"{r['ns_tflop']:.2f} ({r['planned_ns_tflop']:.2f}) | {r['moved_gib']:.2f} "
               f"({r['planned_all_to_all_gib']:.2f}) | " if muon else "- | - | ")
            + f"{r['all_gather_gib']:.2f} | {r['budget_ms']:.1f} | "
            + (f"{100 * r['overhead']:+.1f}% ({100 * r['planned_overhead']:+.1f}%) |" if muon else "- |"))
    lines += ["", "The planner's own time for Muon's terms (its GEMM rate is the one fitted on measured steps, below "
              "the lone-GEMM ceiling the budget uses): "
              + "; ".join(f"{r['mesh']} {r['variant']}: Newton-Schulz {r['planned_optimizer_ms']:.0f} ms, "
                          f"moves {r['planned_optimizer_comm_ms']:.0f} ms" for r in rows if r["variant"] != "adamw"),
              ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h100", choices=("h100", "h200"))
    args = parser.parse_args(argv)
    rows = [r for name in MESHES for r in measure(args.gpu, name, list(VARIANTS))]
    name = "muon_plan" if args.gpu == "h100" else f"muon_plan_{args.gpu}"
    command = "python benchmarks/muon_plan.py" + ("" if args.gpu == "h100" else f" --gpu {args.gpu}")
    results.write(name, rows, table(rows, args.gpu, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
