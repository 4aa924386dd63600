"""Calibrates the planner's time model on published runs and checks it on the ones it was not fitted on.

    python benchmarks/plan_calibration.py             # the table with the constants in jaxtron/planning/gpus.py
    python benchmarks/plan_calibration.py --fit       # fits the constants anew on the fit runs and prints them

The runs are ``jaxtron/planning/published.py``'s (KempnerForge's 14 H200 runs in nodes of 4). For each, the
planner estimates tokens/s for the run's own layout, batch and microbatches (``estimate``, the GPU's node size
as the run's). ``--fit`` fits the three constants of the time model that no compile can tell, by least squares of
the log of estimated over measured tokens/s on the runs marked ``fit``, starting from the current ones:

- ``matmul_efficiency``: the share of the dense bf16 peak a step's GEMMs sustain;
- ``comm_overlap``: how much of the compute the gathers and gradient reductions over fsdp and data hide behind
  (1: all of it, as long as they take no longer than the compute);
- ``tensor_efficiency``: what tensor parallelism leaves of the GEMM rate.

The fitted values go into ``jaxtron/planning/gpus.py`` by hand (the table then says which constants it used); the
table, its errors and the planner's rank of each GPU count's best published layout are written to
``benchmarks/plan_calibration.md`` and ``.json``.
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
# not its bytes (TP=2 costs as much of the step as TP=4), which ``tensor_efficiency`` carries. The network's does
# not move: in the fit runs that cross nodes the gathers stay within what the compute hides.
CONSTANTS = ("matmul_efficiency", "comm_overlap", "tensor_efficiency")


def gpu_of(run, constants: dict[str, float] | None = None):
    from jaxtron.planning.gpus import gpu

    out = dataclasses.replace(gpu(run.gpu), gpus_per_node=run.gpus_per_node)
    return dataclasses.replace(out, **constants) if constants else out


def estimated(run, constants: dict[str, float] | None = None):
    from jaxtron.planning.estimate import estimate

    return estimate(run.config(), run.sizes, gpu_of(run, constants))


def fit(runs) -> dict[str, float]:
    """The constants minimizing the squared log error on ``runs`` (bounded to physical ranges)."""
    import numpy as np
    from scipy.optimize import least_squares

    start = gpu_of(runs[0])
    x0 = np.array([getattr(start, name) for name in CONSTANTS])
    scale = x0.copy()

    def residuals(x):
        constants = dict(zip(CONSTANTS, x * scale, strict=True))
        return [math.log(estimated(r, constants).tokens_per_s / r.tokens_per_s) for r in runs]

    lower = np.array([0.2, 0.0, 0.2]) / scale
    upper = np.array([0.95, 1.0, 1.0]) / scale
    result = least_squares(residuals, np.clip(np.ones_like(x0), lower, upper), bounds=(lower, upper))
    return dict(zip(CONSTANTS, (float(v) for v in result.x * scale), strict=True))


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
    parser.add_argument("--fit", action="store_true", help="fit the constants anew and print them")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "plan_calibration"),
                        help="path of the results without extension (.md and .json are written)")
    args = parser.parse_args(argv)
    constants = None
    if args.fit:
        constants = fit([r for r in published.RUNS if r.fit])
        print("fitted: " + ", ".join(f"{k}={v:.4g}" for k, v in constants.items()))
    used = {name: getattr(gpu_of(published.RUNS[0], constants), name) for name in CONSTANTS}
    rows = []
    for run in published.RUNS:
        e = estimated(run, constants)
        rows.append(dict(number=run.number, model=run.model, layout=run.layout, gpus=run.gpus, fit=run.fit,
                         measured=run.tokens_per_s, estimated=e.tokens_per_s,
                         error=e.tokens_per_s / run.tokens_per_s - 1, step_s=e.step_s, time=e.time))
    ranks = [dict(gpus=b[0], model=b[1], layout=" ".join(f"{a}={s}" for a, s in b[2]) or "one GPU",
                  rank=rank_of_best(b, constants), among_runs=rank_among_runs(b, constants)) for b in published.BEST]
    held = [abs(r["error"]) for r in rows if not r["fit"]]
    lines = [f"Constants ({'fitted now' if args.fit else 'jaxtron/planning/gpus.py'}): "
             + ", ".join(f"{k} {v:.4g}" for k, v in used.items()), "",
             "| # | model | layout | GPUs | fitted on | measured tok/s | estimated | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['number']} | {r['model']} | {r['layout']} | {r['gpus']} | {'yes' if r['fit'] else 'no'} | "
                     f"{r['measured']:,.0f} | {r['estimated']:,.0f} | {100 * r['error']:+.1f}% |")
    within = sum(e <= 0.20 for e in held)
    lines += ["", f"Held out: {within} of {len(held)} within 20% (largest {100 * max(held):.1f}%).",
              "", ("The report's best layout at each GPU count (by its MFU): the planner's rank of it among the "
                   "report's runs on as many GPUs (by estimated MFU), and among every mesh it searches (most of which "
                   "the report did not run: data parallelism with the distributed optimizer, pipelines, context "
                   "parallelism):"), "",
              ("| GPUs | the report's best layout | rank among the report's runs | rank among all meshes | meshes "
               "ranked | planner's first |"),
              "|---|---|---|---|---|---|"]
    for r in ranks:
        rank, count, first = r["rank"]
        among, runs = r["among_runs"]
        lines.append(f"| {r['gpus']} | {r['model']} {r['layout']} | {among} of {runs} | {rank or 'not ranked'} | "
                     f"{count} | {first} |")
    megatron = []
    for run in published.MEGATRON_RUNS:
        e = estimated(run, constants)
        megatron.append(dict(number=run.number, model=run.model, layout=run.layout, gpus=run.gpus,
                             source=run.source, tflops=run.tflops, measured=run.tokens_per_s, estimated=e.tokens_per_s,
                             error=e.tokens_per_s / run.tokens_per_s - 1, mfu=e.mfu, time=e.time))
    lines += ["", "Megatron's H100 runs (another stack; not fitted, the constants above):", "",
              "| # | model | layout | GPUs | published TFLOP/s | measured tok/s | estimated | error | est. MFU |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in megatron:
        lines.append(f"| {r['number']} | {r['model']} | {r['layout']} | {r['gpus']} | {r['tflops']:.0f} | "
                     f"{r['measured']:,.0f} | {r['estimated']:,.0f} | {100 * r['error']:+.1f}% | "
                     f"{100 * r['mfu']:.1f}% |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.fit:
        with open(args.out + ".md", "w") as f:
            f.write(text)
        with open(args.out + ".json", "w") as f:
            json.dump({"constants": used, "runs": rows, "best": ranks, "megatron": megatron}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
