"""Checks the planner's memory estimate against the compiler: for each (model, mesh) pair, compile the real
train step on fake CPU devices (jaxtron.planning.dry_run) and compare XLA's per-device peak with the estimate
of the same program (``estimate(..., cpu_program=True)``).

    python benchmarks/plan_validation.py --out benchmarks/plan_validation.md
    python benchmarks/plan_validation.py --estimate-only   # the compiled numbers of the .json, estimates anew
    python benchmarks/plan_validation.py --recompile mesh.pipeline   # those pairs compiled anew, the rest kept

Each pair runs twice: with the config's bfloat16 compute, and with float32 compute, where the CPU program
holds the same dtypes a GPU's would (XLA:CPU converts 16-bit matmul operands to float32, see
jaxtron/planning/estimate.py). One subprocess per compile, since the fake device count is fixed at start.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIRS = [  # (config, devices, overrides)
    ("llama3_8b", 8, ["data.seq_len=4096", "train.global_batch_size=8"]),
    ("llama3_8b", 8, ["data.seq_len=4096", "train.global_batch_size=8", "mesh.fsdp=4", "mesh.tensor=2"]),
    ("llama3_8b", 8, ["data.seq_len=4096", "train.global_batch_size=16", "mesh.fsdp=4", "mesh.data=2"]),
    ("llama3_8b", 8, ["data.seq_len=2048", "train.global_batch_size=16", "execution.remat=save_dots"]),
    ("llama3_8b", 8, ["data.seq_len=8192", "train.global_batch_size=8", "mesh.fsdp=4", "mesh.sequence=2"]),
    ("llama3_1b", 8, ["data.seq_len=2048", "train.global_batch_size=16"]),
    ("llama3_1b", 8, ["data.seq_len=4096", "train.global_batch_size=32", "train.microbatches=2"]),
    ("llama3_70b", 64, ["data.seq_len=4096", "train.global_batch_size=64"]),
    ("llama3_70b", 64, ["data.seq_len=4096", "train.global_batch_size=32", "mesh.fsdp=16", "mesh.tensor=4"]),
    ("mixtral_8x7b", 64, ["data.seq_len=4096", "train.global_batch_size=64"]),
    # pipeline meshes: fill-drain with one microbatch per stage, with virtual stages, and the 70B reference layout
    ("llama3_8b", 8, ["data.seq_len=4096", "train.global_batch_size=16", "mesh.fsdp=4", "mesh.pipeline=2"]),
    ("llama3_8b", 8, ["data.seq_len=4096", "train.global_batch_size=16", "mesh.fsdp=1", "mesh.tensor=2",
                      "mesh.pipeline=4"]),
    ("llama3_8b", 8, ["data.seq_len=4096", "train.global_batch_size=16", "mesh.fsdp=4", "mesh.pipeline=2",
                      "pipeline.virtual_stages=2", "pipeline.microbatches=4"]),
    ("llama3_70b", 64, ["data.seq_len=8192", "train.global_batch_size=16", "mesh.fsdp=2", "mesh.tensor=4",
                        "mesh.sequence=2", "mesh.pipeline=4"]),
    # DeepSeek-V3's latent attention, dense first blocks, shared experts and prediction module, with 32 routed
    # experts so that the activations weigh beside the state, in capacity mode (XLA:CPU expands a dropless
    # grouped GEMM to every row times every local expert; jaxtron/models/moe.py); flat and pipelined (58 MoE
    # layers on 4 stages, 2 identity ones)
    ("deepseek_v3", 64, ["data.seq_len=4096", "train.global_batch_size=256", "execution.moe_mode=capacity",
                         "model.moe.num_experts=32", "mesh.fsdp=8", "mesh.expert=8"]),
    ("deepseek_v3", 64, ["data.seq_len=4096", "train.global_batch_size=256", "execution.moe_mode=capacity",
                         "model.moe.num_experts=32", "mesh.fsdp=2", "mesh.expert=8", "mesh.pipeline=4",
                         "pipeline.uneven_stages=True"]),
]
GIB = 2.0**30
TOLERANCE = 0.15


def compile_one(config: str, devices: int, overrides: list[str]) -> dict:
    """Runs the dry run in a fresh process with ``devices`` fake CPU devices; returns its numbers."""
    code = ("import json, sys; from jaxtron.config.loader import load_config; "
            "from jaxtron.planning.dry_run import dry_run; "
            "cfg = load_config(sys.argv[1], [tuple(a.split('=', 1)) for a in sys.argv[2:]]); r = dry_run(cfg); "
            "print(json.dumps(dict(peak=r.peak_bytes, arguments=r.argument_bytes, temp=r.temp_bytes, "
            "compile_s=r.compile_s, collectives={k: v['bytes'] for k, v in r.collectives.items()})))")
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "configs", f"{config}.py"), *overrides],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def estimate_of(config: str, devices: int, overrides: list[str]):
    """(mesh sizes, the planner's estimate) of the program ``compile_one`` compiles for the same arguments."""
    sys.path.insert(0, ROOT)
    from jaxtron.config.loader import load_config
    from jaxtron.parallel.checks import check_devices
    from jaxtron.planning.estimate import estimate
    from jaxtron.planning.gpus import gpu
    cfg = load_config(os.path.join(ROOT, "configs", f"{config}.py"), [tuple(a.split("=", 1)) for a in overrides])
    sizes = check_devices(cfg, devices)
    return sizes, estimate(cfg, sizes, gpu("h100"), cpu_program=True)


def arguments(doc: str, table: str, recompile: bool = False) -> argparse.Namespace:
    """The command line of a planner benchmark: where its table goes (``--out``, default benchmarks/TABLE; the
    .json beside it holds the rows), ``--estimate-only`` and (``recompile``) ``--recompile``."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", table))
    parser.add_argument("--estimate-only", action="store_true",
                        help="keep the compiled numbers of the .json beside --out, recompute the estimates")
    if recompile:
        parser.add_argument("--recompile", metavar="TEXT", default=None,
                            help="as --estimate-only, but compile anew the pairs with an override containing TEXT")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)  # before the compiling, not after it
    return args


def main() -> int:
    args = arguments(__doc__, "plan_validation.md", recompile=True)
    compiled = {}
    if args.estimate_only or args.recompile:
        with open(os.path.splitext(args.out)[0] + ".json") as f:
            compiled = {(r["config"], r["devices"], tuple(r["overrides"])): r for r in json.load(f)
                        if not (args.recompile and any(args.recompile in o for o in r["overrides"]))}
    rows = []
    for config, devices, overrides in PAIRS:
        for dtype in ("bfloat16", "float32"):
            over = overrides + [f"execution.dtype={dtype}"]
            sizes, est = estimate_of(config, devices, over)
            before = compiled.get((config, devices, tuple(over)))
            got = before["compiled"] if before else compile_one(config, devices, over)
            commit = before["commit"] if before and "commit" in before else _commit()
            error = est.memory_bytes / got["peak"] - 1
            rows.append(dict(config=config, devices=devices, overrides=over, mesh=sizes, compiled=got, commit=commit,
                             estimated=est.memory_bytes, estimated_terms=est.memory, error=error,
                             estimated_collectives=est.collectives))
            print(f"{config:<13} {' '.join(overrides):<70} {dtype:<8} compiled {got['peak'] / GIB:7.2f} GiB "
                  f"estimated {est.memory_bytes / GIB:7.2f} GiB {100 * error:+6.1f}%", flush=True)
    write(args.out, rows)
    return 0


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=False).stdout.strip()


def write(path: str, rows: list[dict]) -> None:
    import jax

    commit = ", ".join(sorted({r.get("commit") or _commit() for r in rows}))
    inside = sum(abs(r["error"]) <= TOLERANCE for r in rows)
    lines = [
        "# Planner memory estimate vs the compiler",
        "",
        (f"Command: `python benchmarks/plan_validation.py` (compiled at commit {commit}, jax {jax.__version__}, "
        f"{platform.machine()} CPU, fake devices). Compiled: XLA's memory analysis of the real train step "
        "(arguments + temporaries + outputs not aliased to donated inputs), per device. Estimated: "
        "`jaxtron.planning.estimate.estimate(cfg, mesh, cpu_program=True)`, the analytic model of the same program."),
        "",
        f"{inside} of {len(rows)} estimates are within {TOLERANCE:.0%} of the compiled peak.",
        "",
        ("| model | devices | mesh | seq | rows/device | remat | micro | pipeline (M x V) | dtype | "
        "compiled GiB (args + temp) | estimated GiB | error |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        over = dict(o.split("=", 1) for o in r["overrides"])
        mesh = " ".join(f"{a}={v}" for a, v in r["mesh"].items() if v > 1)
        dp = r["mesh"]["data"] * r["mesh"]["fsdp"] * r["mesh"]["expert"]
        stages = r["mesh"].get("pipeline", 1)
        schedule = (f"{over.get('pipeline.microbatches', stages)} x {over.get('pipeline.virtual_stages', 1)}"
                    if stages > 1 else "-")
        c = r["compiled"]
        lines.append(
            f"| {_label(r)} | {r['devices']} | {mesh} | {over['data.seq_len']} | "
            f"{int(over['train.global_batch_size']) // dp} | {over.get('execution.remat', 'full')} | "
            f"{over.get('train.microbatches', 1)} | {schedule} | {over['execution.dtype']} | {c['peak'] / GIB:.2f} "
            f"({c['arguments'] / GIB:.2f} + {c['temp'] / GIB:.2f}) | {r['estimated'] / GIB:.2f} | "
            f"{100 * r['error']:+.1f}% |")
    lines += ["", ("Collective bytes per step and device, compiled vs estimated (GiB; XLA:CPU emits all-reduce where "
              "a GPU reduce-scatters, so those two are summed):"), "",
              "| model | mesh | dtype | all-gather | all-reduce + reduce-scatter | all-to-all | collective-permute |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        c, e = r["compiled"]["collectives"], r["estimated_collectives"]
        mesh = " ".join(f"{a}={v}" for a, v in r["mesh"].items() if v > 1)
        pair = lambda got, want: f"{got / GIB:.1f} / {want / GIB:.1f}"
        lines.append(f"| {_label(r)} | {mesh} | {dict(o.split('=', 1) for o in r['overrides'])['execution.dtype']} | "
                     f"{pair(c['all-gather'], e['all-gather'])} | "
                     f"{pair(c['all-reduce'] + c['reduce-scatter'], e['all-reduce'] + e['reduce-scatter'])} | "
                     f"{pair(c['all-to-all'], e['all-to-all'])} | "
                     f"{pair(c.get('collective-permute', 0.0), e.get('collective-permute', 0.0))} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(rows, f, indent=1)


def _label(row: dict) -> str:
    """The config's name, with the model fields and the MoE mode its overrides change."""
    changed = [o.split(".", 1)[1] for o in row["overrides"] if o.startswith(("model.", "execution.moe_mode"))]
    return f"{row['config']} ({', '.join(changed)})" if changed else row["config"]


if __name__ == "__main__":
    sys.exit(main())
