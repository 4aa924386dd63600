"""AdamW against Muon on the same tokens: the main job (configs/default.py, real text) trained with each optimizer at
several peak learning rates, its validation loss against the tokens trained, as a table (optimizers.md,
optimizers.json) and a plot (optimizers.png).

    python benchmarks/optimizers.py [--rates 1e-3,3e-3,1e-2] [--steps 300] [--eval-every 25] [--add muon:3e-2]
    python benchmarks/optimizers.py --name optimizers_larger --set model.embed_dim=256 ... --runs adamw:1e-3,...

Each run is the main job as shipped (same data order, schedule, weight decay and clipping) with
``optimizer.name`` and ``optimizer.learning_rate`` changed (and the ``--set`` overrides, for a larger model),
validation every ``--eval-every`` steps; ``--name`` is the results' file stem. The table says,
for each Muon run, how many tokens it took to reach the best AdamW run's final validation loss (interpolated
between evaluations), as a share of the tokens AdamW trained.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import results


def _run(name: str, rate: float, steps: int, eval_every: int, workdir: str, overrides: list[str]) -> dict:
    import jax

    from jaxtron.config.loader import load_config
    from jaxtron.training.loop import run

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(here, "configs", "default.py"), [
        ("optimizer.name", name), ("optimizer.learning_rate", str(rate)), ("train.steps", str(steps)),
        ("train.eval_every", str(eval_every)), *(tuple(o.split("=", 1)) for o in overrides)])
    started = time.perf_counter()
    run(cfg, workdir, use_tqdm=False, devices=jax.devices()[:1])
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
    with open(os.path.join(workdir, "metrics.jsonl")) as f:  # the evaluations' lines (the run is whole)
        lines = [json.loads(line) for line in f if line.strip()]
    evals = [(line["step"] * tokens_per_step, line["eval/loss"]) for line in lines if "eval/loss" in line]
    return dict(optimizer=name, learning_rate=rate, steps=steps, tokens=steps * tokens_per_step,
                validation=evals, final_validation=evals[-1][1], wall_s=round(time.perf_counter() - started, 1))


def tokens_to_reach(validation: list[tuple[int, float]], target: float) -> float | None:
    """The tokens at which a run's validation loss first reaches ``target``, linear between evaluations; None if it
    never does."""
    before = (0, float("inf"))
    for tokens, loss in validation:
        if loss <= target:
            if not np.isfinite(before[1]):
                return float(tokens)
            return before[0] + (tokens - before[0]) * (before[1] - target) / (before[1] - loss)
        before = (tokens, loss)
    return None


def table(rows: list[dict], command: str, job: str, plot_file: str) -> str:
    adamw = [r for r in rows if r["optimizer"] == "adamw"]
    best = min(adamw, key=lambda r: r["final_validation"])
    lines = [f"# AdamW against Muon on {job} (CPU)", "", f"`{command}`", "",
             "| optimizer | peak learning rate | final validation loss | tokens to the best AdamW loss | share | s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        reach = tokens_to_reach(r["validation"], best["final_validation"])
        share = f"{reach / best['tokens']:.2f}" if reach is not None else "not reached"
        lines.append(f"| {r['optimizer']} | {r['learning_rate']:g} | {r['final_validation']:.4f} | "
                     f"{'-' if reach is None else f'{reach:,.0f}'} | {share} | {r['wall_s']} |")
    summary = (f"Best AdamW run: peak {best['learning_rate']:g}, final validation loss "
               f"{best['final_validation']:.4f} after {best['tokens']:,} tokens. The share is the tokens a run took "
               "to reach that loss over the tokens AdamW took (linear between evaluations).")
    for name in ("adamw", "muon"):  # a best rate at the edge of the sweep may not be the optimizer's best
        runs = [r for r in rows if r["optimizer"] == name]
        top = min(runs, key=lambda r: r["final_validation"])["learning_rate"]
        rates = sorted(r["learning_rate"] for r in runs)
        if top in (rates[0], rates[-1]):
            summary += (f" {name}'s best rate, {top:g}, is at the edge of the rates tried: a rate beyond it may do "
                        "better still.")
    lines += ["", summary, "", f"![validation loss against tokens]({plot_file})", ""]
    return "\n".join(lines)


def plot(rows: list[dict], path: str, job: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jaxtron.common.files import atomic_path

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        tokens, loss = zip(*r["validation"], strict=True)
        ax.plot(tokens, loss, ("-" if r["optimizer"] == "muon" else "--"), marker=".",
                label=f"{r['optimizer']} {r['learning_rate']:g}")
    ax.set_xlabel("tokens trained")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("\n".join(textwrap.wrap(f"{job}: AdamW against Muon", 80)), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as aside:
        fig.savefig(aside, format="png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1e-3,3e-3,1e-2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--runs", default="", help="NAME:RATE,...: these runs in place of both optimizers at --rates")
    parser.add_argument("--add", default="", help="NAME:RATE,...: run these alone and add them to the rows on file "
                                                    "(a sweep widened where its best rate was at an edge)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override of every run (repeat it): a larger model than the main job's")
    parser.add_argument("--name", default="optimizers", help="the results' file stem in benchmarks/")
    args = parser.parse_args(argv)
    listed = args.add or args.runs
    runs = [(name, float(rate)) for name, rate in (item.split(":") for item in listed.split(","))] if listed \
        else [(name, float(rate)) for name in ("adamw", "muon") for rate in args.rates.split(",")]
    rows = []
    if args.add:
        with open(os.path.join(results.HERE, f"{args.name}.json")) as f:
            rows = json.load(f)
    with tempfile.TemporaryDirectory() as root:
        for name, rate in runs:
            rows.append(_run(name, rate, args.steps, args.eval_every, os.path.join(root, f"{name}_{rate:g}"),
                             args.set))
            print(rows[-1]["optimizer"], rows[-1]["learning_rate"], rows[-1]["final_validation"], flush=True)
    rows.sort(key=lambda r: (r["optimizer"], r["learning_rate"]))
    given = [f"--name {args.name}"] if args.name != "optimizers" else []
    given += [f"--set {o}" for o in args.set] + ([f"--runs {args.runs}"] if args.runs else [])
    given += [f"--steps {args.steps}"] if args.steps != 300 else []
    given += [f"--add {args.add}"] if args.add else []
    command = " ".join(["python benchmarks/optimizers.py", *given])
    if args.add:  # after the commands that made the rows on file, as their table names them
        with open(os.path.join(results.HERE, f"{args.name}.md")) as f:
            before = next(line.strip() for line in f if line.startswith("`python "))
        command = f"{before.strip('`')}`, then `{command}"
    job = "the main job" + (f" with {', '.join(args.set)}" if args.set else "")
    results.write(args.name, rows, table(rows, command, job, f"{args.name}.png"))
    plot(rows, os.path.join(results.HERE, f"{args.name}.png"), job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
