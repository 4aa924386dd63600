"""Calibrates the planner's time model on published runs, and checks it on each run with constants fitted without it.

    python benchmarks/plan_calibration.py             # the tables, with the constants in jaxtron/planning/gpus.py
    python benchmarks/plan_calibration.py --fit       # fits the constants anew on all the runs and prints them

The runs are ``jaxtron/planning/published.py``'s: KempnerForge's 14 H200 runs in nodes of 4, and Megatron's H100
runs. For each, the planner estimates tokens/s for the run's own layout, batch and microbatches (``estimate``, the
GPU's node size as the run's). ``--fit`` fits the four constants of the time model that no compile can tell, by
least squares of the log of estimated over measured tokens/s on KempnerForge's runs:

- ``matmul_efficiency``: the share of the dense bf16 peak a step's GEMMs sustain;
- ``comm_overlap``: how much of the compute the gathers and gradient reductions over fsdp and data hide behind
  (1: all of it, as long as they take no longer than the compute);
- ``comm_interference``: the share of the hidden collectives' time the step still pays (their kernels share the
  SMs and memory bandwidth with the GEMMs);
- ``tensor_efficiency``: what tensor parallelism leaves of the GEMM rate in KempnerForge's stack (beyond its
  collectives' bytes, which the model counts); Megatron's own is fitted on Megatron's runs with the other three
  fixed.

Each run's held-out error comes from the constants fitted on the other 13 (leave-one-out), so no run checks a fit
it took part in. The fitted values go into ``jaxtron/planning/gpus.py`` by hand; the tables, their errors and the
planner's rank of each GPU count's best published layout are written to ``benchmarks/plan_calibration.md`` and
``.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The bandwidths stay the table's (80% of NVLink's 450 GB/s and of the network's 50 GB/s per GPU, what NCCL's bus
# bandwidth reaches). Fitted, NVLink's runs to its bound: the tensor group's cost in these runs follows its compute,
# not its bytes (TP=2 costs as much of the step as TP=4), which ``tensor_efficiency`` carries.
CONSTANTS = ("matmul_efficiency", "comm_overlap", "comm_interference", "tensor_efficiency")
BOUNDS = ((0.2, 0.95), (0.0, 1.0), (0.0, 1.0), (0.2, 1.0))


def gpu_of(run, constants: dict[str, float] | None = None):
    """The planner's GPU for ``run``: its table entry with the run's node size and its stack's tensor-parallel cost
    (``STACK_TENSOR_EFFICIENCY``) and weight traffic (``STACK_WEIGHT_PASS_BYTES``), ``constants`` in place of the
    table's (their ``tensor_efficiency`` is KempnerForge's: it applies to KempnerForge's runs alone)."""
    from jaxtron.planning.gpus import STACK_TENSOR_EFFICIENCY, STACK_WEIGHT_PASS_BYTES, gpu
    from jaxtron.planning.published import KEMPNERFORGE_STACK

    out = dataclasses.replace(gpu(run.gpu), gpus_per_node=run.gpus_per_node,
                              tensor_efficiency=STACK_TENSOR_EFFICIENCY[run.stack],
                              weight_pass_bytes=STACK_WEIGHT_PASS_BYTES[run.stack])
    if constants:
        out = dataclasses.replace(out, **{k: v for k, v in constants.items()
                                          if k != "tensor_efficiency" or run.stack == KEMPNERFORGE_STACK})
    return out


def estimated(run, constants: dict[str, float] | None = None):
    from jaxtron.planning.estimate import estimate

    return estimate(run.config(), run.sizes, gpu_of(run, constants))


def table_constants() -> dict[str, float]:
    """The constants the planner uses for KempnerForge's runs (``jaxtron/planning/gpus.py``)."""
    from jaxtron.planning import published

    return {name: getattr(gpu_of(published.RUNS[0]), name) for name in CONSTANTS}


def _least_squares(residuals, start: list[float], bounds) -> list[float]:
    import numpy as np
    from scipy.optimize import least_squares

    lower, upper = (np.array(b, float) for b in zip(*bounds, strict=True))
    scale = np.where(np.array(start) > 0, start, 1.0)
    x0 = np.clip(np.where(np.array(start) > 0, 1.0, 0.1), lower / scale, upper / scale)
    result = least_squares(lambda x: residuals(x * scale), x0, bounds=(lower / scale, upper / scale), x_scale=1.0)
    return [float(v) for v in result.x * scale]


def fit(runs, start: dict[str, float] | None = None) -> dict[str, float]:
    """The constants minimizing the squared log error on KempnerForge's ``runs``, searched from ``start`` (default:
    the table's), within physical bounds."""
    start = start or table_constants()

    def residuals(x):
        constants = dict(zip(CONSTANTS, x, strict=True))
        return [math.log(estimated(r, constants).tokens_per_s / r.tokens_per_s) for r in runs]

    return dict(zip(CONSTANTS, _least_squares(residuals, [start[k] for k in CONSTANTS], BOUNDS), strict=True))


def fit_stack_tensor_efficiency(runs, constants: dict[str, float]) -> float:
    """Another stack's ``tensor_efficiency``, fitted on its ``runs`` with tensor parallelism, ``constants``' others
    fixed."""
    from jaxtron.planning.estimate import estimate

    runs = [r for r in runs if r.sizes["tensor"] > 1]
    shared = {k: v for k, v in constants.items() if k != "tensor_efficiency"}

    def residuals(x):
        return [math.log(estimate(r.config(), r.sizes, dataclasses.replace(
            gpu_of(r), **shared, tensor_efficiency=float(x[0]))).tokens_per_s / r.tokens_per_s) for r in runs]

    return _least_squares(residuals, [0.8], [BOUNDS[CONSTANTS.index("tensor_efficiency")]])[0]


def held_out(runs, constants: dict[str, float]) -> dict[int, dict[str, float]]:
    """Each run's estimate with the constants fitted on the others (searched from ``constants``)."""
    out = {}
    for run in runs:
        others = fit([r for r in runs if r is not run], start=constants)
        out[run.number] = dict(constants=others, estimated=estimated(run, others).tokens_per_s)
    return out


def rank_of_best(best, gpu_constants: dict[str, float] | None = None) -> tuple[int, int, str]:
    """(the planner's rank of the published best layout among its meshes for that model and GPU count, how many
    it ranked, its first choice), the batch and microbatches as the published run had them."""
    from jaxtron.planning import published, search

    gpus, model, mesh = best
    run = next(r for r in published.RUNS if r.model == model and r.mesh == mesh)
    cfg = run.config()
    rows = search.plan(cfg, gpus, gpu_of(run, gpu_constants))
    wanted = run.sizes
    ranked = [r for r in rows if r.fits] or rows
    for i, row in enumerate(ranked, 1):
        if {a: row.estimate.mesh.get(a, 1) for a in wanted} == wanted:
            return i, len(ranked), search.mesh_text(ranked[0].estimate.mesh)
    return 0, len(ranked), search.mesh_text(ranked[0].estimate.mesh) if ranked else "none"


def meshes_of_kinds(best, gpu_constants: dict[str, float] | None = None) -> list[dict[str, int]]:
    """Every mesh of the kinds the report ran (fsdp and tensor parallelism and their products, measured or not) on
    the published best layout's model and GPU count, as the planner ranks them by estimated MFU (those that fit)."""
    from jaxtron.planning import published, search

    gpus, model, mesh = best
    run = next(r for r in published.RUNS if r.model == model and r.mesh == mesh)
    kinds = {a for r in published.RUNS for a, _ in r.mesh}
    rows = [r for r in search.plan(run.config(), gpus, gpu_of(run, gpu_constants))
            if all(size == 1 or axis in kinds for axis, size in r.estimate.mesh.items())]
    ranked = [r for r in rows if r.fits] or rows
    return [{a: s for a, s in r.estimate.mesh.items() if s > 1} for r in ranked]


def rank_among_kinds(best, gpu_constants: dict[str, float] | None = None) -> tuple[int, int]:
    """(the planner's rank of the published best layout among every mesh of the kinds the report ran
    (``meshes_of_kinds``); how many such meshes fit)."""
    meshes = meshes_of_kinds(best, gpu_constants)
    return meshes.index(dict(best[2])) + 1, len(meshes)


def rank_among_runs(best, gpu_constants: dict[str, float] | None = None) -> tuple[int, int]:
    """(the planner's rank of the published best layout among the report's own runs on as many GPUs, by estimated
    MFU, how many runs that is): the order of layouts that were measured, which the planner can be held to."""
    from jaxtron.planning import published

    gpus, model, mesh = best
    runs = [r for r in published.RUNS if r.gpus == gpus]
    mfu = {(r.model, r.mesh): estimated(r, gpu_constants).mfu for r in runs}
    order = sorted(mfu, key=mfu.get, reverse=True)
    return order.index((model, mesh)) + 1, len(order)


def main(argv: list[str]) -> int:
    from jaxtron.planning import published

    parser = argparse.ArgumentParser(prog="benchmarks/plan_calibration.py", description=__doc__.split("\n")[0])
    parser.add_argument("--fit", action="store_true", help="fit the constants anew on all the runs and print them")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "plan_calibration"),
                        help="path of the results without extension (.md and .json are written)")
    args = parser.parse_args(argv)
    constants = table_constants()
    if args.fit:
        constants = fit(published.RUNS, start=constants)
        megatron_te = fit_stack_tensor_efficiency(published.MEGATRON_RUNS, constants)
        print("fitted: " + ", ".join(f"{k}={v:.4g}" for k, v in constants.items())
              + f"; Megatron's tensor_efficiency={megatron_te:.4g}")
        return 0
    others = held_out(published.RUNS, constants)
    rows = []
    for run in published.RUNS:
        e = estimated(run, constants)
        out = others[run.number]
        rows.append(dict(number=run.number, model=run.model, layout=run.layout, gpus=run.gpus,
                         measured=run.tokens_per_s, estimated=e.tokens_per_s,
                         error=e.tokens_per_s / run.tokens_per_s - 1, held_out=out["estimated"],
                         held_out_error=out["estimated"] / run.tokens_per_s - 1, held_out_constants=out["constants"],
                         step_s=e.step_s, time=e.time))
    ranks = [dict(gpus=b[0], model=b[1], layout=" ".join(f"{a}={s}" for a, s in b[2]) or "one GPU",
                  rank=rank_of_best(b), among_runs=rank_among_runs(b),
                  among_kinds=rank_among_kinds(b)) for b in published.BEST]
    held = [abs(r["held_out_error"]) for r in rows]
    spread = {k: (min(r["held_out_constants"][k] for r in rows), max(r["held_out_constants"][k] for r in rows))
              for k in CONSTANTS}
    lines = ["Constants (jaxtron/planning/gpus.py, fitted on all 14 runs): "
             + ", ".join(f"{k} {v:.4g}" for k, v in constants.items()) + "; fitted on 13 runs at a time: "
             + ", ".join(f"{k} {lo:.3g}-{hi:.3g}" for k, (lo, hi) in spread.items()), "",
             ("| # | model | layout | GPUs | measured tok/s | estimated | error | held out: fitted on the other 13 | "
              "error |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['number']} | {r['model']} | {r['layout']} | {r['gpus']} | {r['measured']:,.0f} | "
                     f"{r['estimated']:,.0f} | {100 * r['error']:+.1f}% | {r['held_out']:,.0f} | "
                     f"{100 * r['held_out_error']:+.1f}% |")
    within = sum(e <= 0.20 for e in held)
    lines += ["", f"Held out: {within} of {len(held)} within 20% (largest {100 * max(held):.1f}%).",
              "", ("The report's best layout at each GPU count (by its MFU): the planner's rank of it (by estimated "
                   "MFU, with KempnerForge's tensor-parallel cost) among the report's runs on as many GPUs; among "
                   "every mesh of the kinds the report ran (fsdp, tensor and their products, measured or not); and "
                   "among every mesh it searches, most of kinds the report did not run (data parallelism beside "
                   "fsdp, pipelines, context parallelism), which no measurement here can confirm or refute. A "
                   "layout that does not fit (by the estimate) is not ranked but where nothing fits:"), "",
              ("| GPUs | the report's best layout | rank among the report's runs | rank among meshes of the report's "
               "kinds (fsdp, tensor) | rank among all meshes | meshes ranked | planner's first |"),
              "|---|---|---|---|---|---|---|"]
    for r in ranks:
        rank, count, first = r["rank"]
        among, runs = r["among_runs"]
        kind, kinds = r["among_kinds"]
        lines.append(f"| {r['gpus']} | {r['model']} {r['layout']} | {among} of {runs} | {kind} of {kinds} | "
                     f"{rank or 'not ranked'} | {count} | {first} |")
    megatron = []
    for run in published.MEGATRON_RUNS:
        e = estimated(run)
        megatron.append(dict(number=run.number, model=run.model, layout=run.layout, gpus=run.gpus,
                             source=run.source, tflops=run.tflops, measured=run.tokens_per_s, estimated=e.tokens_per_s,
                             error=e.tokens_per_s / run.tokens_per_s - 1, mfu=e.mfu, time=e.time))
    lines += ["", ("Megatron's H100 runs (another stack; the constants above, and Megatron's tensor-parallel cost, "
                   f"tensor_efficiency {gpu_of(published.MEGATRON_RUNS[0]).tensor_efficiency:.3g}):"), "",
              "| # | model | layout | GPUs | published TFLOP/s | measured tok/s | estimated | error | est. MFU |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in megatron:
        lines.append(f"| {r['number']} | {r['model']} | {r['layout']} | {r['gpus']} | {r['tflops']:.0f} | "
                     f"{r['measured']:,.0f} | {r['estimated']:,.0f} | {100 * r['error']:+.1f}% | "
                     f"{100 * r['mfu']:.1f}% |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    with open(args.out + ".json", "w") as f:
        json.dump({"constants": constants, "runs": rows, "best": ranks, "megatron": megatron}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
