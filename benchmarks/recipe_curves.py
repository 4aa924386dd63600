"""The default job trained with each FP8 recipe beside the 16-bit run: loss curves and where each ends.

    python benchmarks/recipe_curves.py [--steps 300] [--seeds 1] [--out benchmarks/recipe_curves]

Each run is ``train.py --config=configs/default.py`` in bfloat16 at widths of whole 128-element tiles (embed 256,
8 query and 4 key heads of 32: blockwise FP8 needs them; the shipped 192 fits the others), once without FP8 and
once with each recipe, on the CPU (each recipe emulated: the same quantized numbers a GPU computes), each with
``--seeds`` seeds (0, 1, ...): at 60 steps two bf16 seeds end 7% apart, more than any recipe moves the loss, so a
comparison there takes the mean of a few. Writes ``OUT.json`` (every logged loss) and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTHS = ("--config.model.embed_dim=256", "--config.model.attention.num_heads=8",
          "--config.model.attention.num_kv_heads=4", "--config.execution.dtype=bfloat16")
RUNS = {"bf16": (), **{r: ("--config.execution.fp8=True", f"--config.execution.fp8_recipe={r}")
                       for r in ("tensorwise", "blockwise", "mxfp8", "nvfp4")}}


def train(name: str, steps: int, folder: str, seed: int = 0) -> dict:
    """One run's logged losses and its final validation loss, from its metrics.jsonl."""
    workdir = os.path.join(folder, f"{name}-{seed}")
    argv = [sys.executable, os.path.join(ROOT, "train.py"), "--config=configs/default.py", f"--workdir={workdir}",
            f"--config.train.steps={steps}", f"--config.train.eval_every={steps}", f"--config.train.seed={seed}",
            *WIDTHS, *RUNS[name]]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True, env=env)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    return {"losses": losses, "eval_loss": evals[-1] if evals else None}


def seeded(name: str, steps: int, folder: str, seeds: int) -> dict:
    """The first seed's run, its validation loss replaced by the mean of ``seeds`` seeds' (each kept)."""
    found = [train(name, steps, folder, seed) for seed in range(seeds)]
    evals = [run["eval_loss"] for run in found]
    return {**found[0], "eval_loss": sum(evals) / len(evals), "eval_losses": evals}


def markdown(runs: dict, steps: int, commit: str, seeds: int = 1) -> str:
    base = runs["bf16"]
    marks = sorted(base["losses"], key=int)
    shown = [s for s in marks if int(s) % max(1, steps // 6) == 0 or s == marks[-1]]
    lines = ["# The default job with each FP8 recipe", "",
             (f"`python benchmarks/recipe_curves.py --steps {steps} --seeds {seeds}` at commit {commit}, on a 2-core "
              "CPU (the recipes "
              "emulated: the quantized numbers a GPU computes, not its speed). Widths of whole 128-element tiles "
              "(embed 256, 8 query and 4 key heads of 32), bfloat16. The training loss at some logged steps, the "
              "validation loss at the end, and its difference from the run without FP8. With several seeds the "
              "training losses are seed 0's; the validation loss is the seeds' mean, each seed's beside it."), "",
             "| run | " + " | ".join(f"step {s}" for s in shown) + " | validation | vs bf16 | each seed |",
             "|---|" + "---|" * (len(shown) + 3)]
    for name, run in runs.items():
        delta = (run["eval_loss"] / base["eval_loss"] - 1) * 100
        each = ", ".join(f"{v:.4f}" for v in run.get("eval_losses", [run["eval_loss"]]))
        lines.append(f"| {name} | " + " | ".join(f"{run['losses'][s]:.4f}" for s in shown)
                     + f" | {run['eval_loss']:.4f} | {delta:+.2f}% | {each} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "recipe_curves"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        runs = {name: seeded(name, args.steps, folder, args.seeds) for name in RUNS}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                            check=False).stdout.strip()
    with open(args.out + ".json", "w") as f:
        json.dump({"commit": commit, "steps": args.steps, "seeds": args.seeds, "runs": runs}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(runs, args.steps, commit, args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
