"""Which MoE exchanges the H100 program runs beside compute: Mixtral 8x7B (2 of its 32 blocks, expert=8 on 8 GPUs,
inside a node), DeepSeek-V3 (4 blocks: 3 dense, 1 MoE; fsdp=2 expert=8 on 16 GPUs, inside a node) and DeepSeek-V3
across nodes (expert=16 on 2 nodes of 8, rows sent once per node as its planned layouts send them), each with 1, 2
and 4 token chunks (``execution.moe_chunks``). Schedulers: 'off', XLA's default scheduler; 'on', its latency-hiding
scheduler with one collective in flight; 'limit2', with two; 'shipped', what ``models/moe.py`` sets (two in flight
with chunks). Schedules: 'xla', the scheduler weighing kernels and collectives with its own guesses; 'budget', with
the costs of a first compile (``execution.moe_schedule``, ``metrics/schedule.py``). For the exchanges that carry rows:
how many have a GEMM between their start and their done, and the share of their transfer time the kernels between
hide (``jaxtron.metrics.overlap``, kernels at the budget's H100 rates) at NVLink's and at the network's bandwidth.

    python benchmarks/moe_overlap.py --variants shipped --schedules xla,budget --name moe_overlap_budget
    python benchmarks/moe_overlap.py --variants off,on --schedules xla     # writes benchmarks/moe_overlap.md
    python benchmarks/moe_overlap.py --variants limit2 --schedules xla --name moe_overlap_limit2

Needs jax's CUDA plugin (``python -m pip install -e ".[gpu-target]"``); each compile runs in its own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
import results  # benchmarks/results.py, found through the path above

CASES = {  # name -> (config, GPUs, overrides)
    "Mixtral 8x7B": ("mixtral_8x7b", 8, ["model.num_layers=2", "train.global_batch_size=8", "mesh.fsdp=1"]),
    "DeepSeek-V3": ("deepseek_v3", 16, ["model.num_layers=4", "train.global_batch_size=16", "mesh.fsdp=2",
                                        "mesh.expert=8"]),
    "DeepSeek-V3 across nodes": ("deepseek_v3", 16, ["model.num_layers=4", "train.global_batch_size=16",
                                                     "mesh.fsdp=1", "mesh.expert=16", "execution.moe_node_shards=8"]),
}
CHUNKS = (1, 2, 4)
# the compile worker; argv: CONFIG_JSON GPU COUNT HLO_FILE SCHEDULER(off|on|limit2|shipped). 'off': neither of
# models/moe.py's options; 'on': the latency-hiding scheduler alone, one collective in flight; 'limit2': the
# scheduler with two in flight at every chunk count; 'shipped': 'on' at one chunk and 'limit2' with chunks.
WORKER = ("import sys; from jaxtron.models import moe\n"
          "if sys.argv[5] == 'off': moe.COMPILER_OPTIONS.clear()\n"
          "if sys.argv[5] == 'limit2': moe.COMPILER_OPTIONS.update(moe.CHUNKED_OPTIONS)\n"
          "if sys.argv[5] != 'shipped': moe.CHUNKED_OPTIONS.clear()\n"
          "from jaxtron.planning.dry_run import target_main; sys.exit(target_main(sys.argv[1:5]))")


def compile_case(config: str, gpus: int, overrides: list[str], scheduler: str) -> dict:
    from jaxtron.config.loader import load_config
    from jaxtron.gpu import preset, target
    from jaxtron.metrics import budget, overlap, schedule
    from jaxtron.planning.gpus import GPUS

    cfg = load_config(os.path.join(ROOT, "configs", f"{config}.py"), [tuple(o.split("=", 1)) for o in overrides])
    gpu = GPUS["h100"]
    with tempfile.TemporaryDirectory() as folder:
        config_path, hlo = os.path.join(folder, "config.json"), os.path.join(folder, "step.hlo")
        with open(config_path, "w") as f:
            json.dump(cfg.to_dict(), f)
        out = subprocess.run([sys.executable, "-c", WORKER, config_path, "h100", str(gpus), hlo, scheduler],
                             env=target.environment(preset_flags=preset.xla_flags()), capture_output=True, text=True,
                             check=False)
        if out.returncode:
            raise RuntimeError(out.stderr[-2000:])
        with open(hlo) as f:
            text = f.read()
    got = json.loads(out.stdout.strip().splitlines()[-1])
    reported = overlap.report(text, budget.H100, {"NVLink": gpu.nvlink_bandwidth, "network": gpu.network_bandwidth})
    # each exchange at the bandwidth of the links its group shares (metrics/schedule.py link_bandwidth)
    links = overlap.summary(overlap.windows(text, budget.H100), schedule.start_links(text, schedule.for_gpu("h100")))
    return {"peak": got["peak_bytes"], "budget_s": got["budget"]["seconds"],
            **{name: r["exchanges"] for name, r in reported.items()}, "links": links["exchanges"]}


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="off,on", help="comma-separated, of off, on, limit2, shipped")
    parser.add_argument("--schedules", default="xla", help="comma-separated, of xla, budget")
    parser.add_argument("--name", default="moe_overlap", help="the files written: benchmarks/NAME.md and .json")
    args = parser.parse_args()
    variants, schedules = args.variants.split(","), args.schedules.split(",")
    if not set(variants) <= {"off", "on", "limit2", "shipped"}:
        parser.error(f"--variants takes off, on, limit2 and shipped, not {args.variants!r}")
    if not set(schedules) <= {"xla", "budget"}:
        parser.error(f"--schedules takes xla and budget, not {args.schedules!r}")
    rows = []
    for name, (config, gpus, overrides) in CASES.items():
        for chunks in CHUNKS:
            for scheduler in variants:
                for costs in schedules:
                    got = compile_case(config, gpus, [*overrides, f"execution.moe_chunks={chunks}",
                                                      f"execution.moe_schedule={costs}"], scheduler)
                    rows.append({"case": name, "chunks": chunks, "scheduler": scheduler, "schedule": costs, **got})
                    print(f"{name:<24} chunks {chunks} {scheduler:<7} {costs:<6}: {got['NVLink']['beside_gemms']} "
                          f"of {got['NVLink']['count']} beside GEMMs, hidden "
                          f"{100 * got['NVLink']['hidden_share']:.0f}% at NVLink, "
                          f"{100 * got['network']['hidden_share']:.0f}% at the network, "
                          f"{100 * got['links']['hidden_share']:.0f}% at their links", flush=True)
    results.write(args.name, rows, markdown(rows, sys.argv[1:]))
    return 0


def markdown(rows: list[dict], argv: list[str] = ()) -> str:
    import jax

    from jaxtron.planning.gpus import GPUS
    from jaxtron.planning.step_time import EXCHANGES_HIDDEN

    assumed = ", ".join(f"{100 * share:.0f}% ({costs}, {'one chunk' if chunks == 1 else 'chunks'})"
                        for (costs, chunks), share in EXCHANGES_HIDDEN.items())

    gpu = GPUS["h100"]
    lines = ["# MoE exchanges beside compute on the H100 program", "",
             (f"Command: `{' '.join(['python benchmarks/moe_overlap.py', *argv])}` (jax {jax.__version__}, "
              "compile-only H100s, no GPU; scheduler 'on': one collective in flight; 'limit2': on, with XLA's "
              "`xla_gpu_experimental_parallel_collective_overlap_limit` at 2, two collectives in flight at once, as "
              "the shipped programs of more than one chunk compile; 'shipped': what models/moe.py sets. Costs: "
              "what the scheduler weighs kernels and collectives with: 'xla', its own guesses; 'budget', a first "
              "compile's costs, execution.moe_schedule, metrics/schedule.py). "
              + "; ".join(f"{name}: `configs/{c}.py` on {g} GPUs, {', '.join(o)}" for name, (c, g, o) in CASES.items())
              + f". Exchanges: the all-to-alls that carry rows (dispatch and combine, in the forward pass, its "
              f"recompute (rows out only) and the backward pass). \"Hidden\": the share of their transfer time that "
              f"the kernels scheduled between their start and done take, at the budget's H100 rates, with the "
              f"transfers at "
              f"NVLink's {gpu.nvlink_bandwidth / 1e9:.0f} GB/s and at the network's "
              f"{gpu.network_bandwidth / 1e9:.0f} GB/s. The planner takes {assumed} as hidden "
              "(`planning/step_time.py` EXCHANGES_HIDDEN). The programs inside a node send their rows over NVLink, the "
              "one across nodes over the network; \"at their links\" prices each exchange at the links its group "
              "shares (the hop inside a node of rows sent once per node runs among the node's devices). How much a "
              "GPU gets needs a multi-GPU run."), "",
             ("| model | chunks | latency-hiding scheduler | costs | exchanges | beside GEMMs | hidden at NVLink | "
             "hidden at the network | hidden at their links | budget ms | peak GiB |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['chunks']} | {r['scheduler']} | {r.get('schedule', 'xla')} | "
                     f"{r['NVLink']['count']} | "
                     f"{r['NVLink']['beside_gemms']} | {100 * r['NVLink']['hidden_share']:.0f}% | "
                     f"{100 * r['network']['hidden_share']:.0f}% | "
                     f"{100 * r['links']['hidden_share']:.0f}% | {1e3 * r['budget_s']:.1f} | "
                     f"{r['peak'] / 2**30:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
