"""The compiled evidence for the GPU preset's XLA flags: Llama-3 8B on 8 compile-only H100s (fsdp=8, the layout
the planner ranks first for it) compiled with XLA's defaults and with each candidate flag, and what each flag
changes in the program: peak memory per device, the collectives, and how many of the asynchronous ones have a GEMM
or attention kernel scheduled between their start and their done (the overlap a GPU can get; its timing needs a
GPU).

    python benchmarks/preset_flags.py                     # writes benchmarks/preset_flags.md and .json

Needs jax's CUDA plugin (``python -m pip install -e ".[gpu-target]"``); each compile runs in its own process.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
import results  # benchmarks/results.py, found through the path above

CONFIG = ("llama3_8b", 8, ["data.seq_len=4096", "train.global_batch_size=8", "execution.dtype=bfloat16"])
CANDIDATES = {  # flag -> what it is meant to do
    "": "XLA's defaults",
    "--xla_gpu_enable_latency_hiding_scheduler=true": "schedule the step so that collectives overlap compute",
    "--xla_gpu_enable_pipelined_all_gather=true": "start a scan iteration's weight all-gather in the one before",
    "--xla_gpu_enable_pipelined_reduce_scatter=true": "finish a scan iteration's gradient reduce-scatter in the next",
    "--xla_gpu_enable_while_loop_double_buffering=true": "unroll the layer scan by two so both halves overlap",
    "--xla_gpu_enable_while_loop_reduce_scatter_code_motion=true": "move a loop's gradient reduce-scatter out of it",
    "--xla_gpu_enable_command_buffer=": "launch kernels one by one instead of as CUDA graphs",
}
GIB = 2.0 ** 30
# a GEMM or attention kernel: the compute a collective should hide behind
_COMPUTE = re.compile(r'"kind":"__triton\w*gemm\w*"|custom_call_target="__(cublas|cudnn)')


def overlap(hlo_text: str) -> dict[str, int]:
    """Asynchronous collectives of the scheduled program (a scheduled module prints each computation in its
    execution order): how many there are, and how many have a GEMM or attention kernel between their start and
    their done."""
    from jaxtron.metrics.hlo import computations

    pairs = overlapped = 0
    for lines in computations(hlo_text)[0].values():
        started: dict[str, int] = {}  # start instruction -> compute kernels seen since
        for line in lines:
            name = line.split("=", 1)[0].strip().removeprefix("ROOT ").strip()
            if re.search(r"-start(\.\d+)? = |\b[\w-]+-start\(", line) and " = " in line:
                started[name] = 0
                continue
            done = re.search(r"-done\((%[\w.\-]+)\)", line)
            if done and done.group(1) in started:
                pairs += 1
                overlapped += started.pop(done.group(1)) > 0
                continue
            if _COMPUTE.search(line):
                for key in started:
                    started[key] += 1
    return {"async_collectives": pairs, "with_compute_between": overlapped}


def compile_with(flag: str) -> dict:
    from jaxtron.config.loader import load_config
    from jaxtron.planning.dry_run import on_target_in_subprocess

    config, gpus, overrides = CONFIG
    cfg = load_config(os.path.join(ROOT, "configs", f"{config}.py"), [tuple(o.split("=", 1)) for o in overrides])
    os.environ["XLA_FLAGS"] = flag
    with tempfile.TemporaryDirectory() as folder:
        hlo = os.path.join(folder, "step.hlo")
        got = on_target_in_subprocess(cfg, "h100", gpus, hlo)
        with open(hlo) as f:
            text = f.read()
    # the program without its metadata (op names, source lines): equal texts are the same program
    program = re.sub(r"metadata=\{[^}]*\}", "", text)
    return {"flag": flag, "peak": got["peak_bytes"], "compile_s": got["compile_s"], "flops": got["flops"],
            "collectives": {k: v["count"] for k, v in got["collectives"].items()}, **overlap(text),
            "program": hashlib.sha256(program.encode()).hexdigest()[:16], "hlo_lines": program.count("\n")}


def main() -> int:
    rows = []
    for flag, purpose in CANDIDATES.items():
        row = {**compile_with(flag), "purpose": purpose}
        row["same_program_as_defaults"] = bool(rows) and row["program"] == rows[0]["program"]
        rows.append(row)
        print(f"{flag or 'defaults':<62} peak {row['peak'] / GIB:6.2f} GiB, {row['with_compute_between']} of "
              f"{row['async_collectives']} async collectives overlap compute"
              + (", the same program as the defaults" if row["same_program_as_defaults"] else ""), flush=True)
    results.write("preset_flags", rows, markdown(rows))
    return 0


def markdown(rows: list[dict]) -> str:
    import jax

    config, gpus, overrides = CONFIG
    lines = ["# XLA flags on the H100 program", "",
             (f"Command: `python benchmarks/preset_flags.py` (jax {jax.__version__}, compile-only H100s, no GPU): "
              f"{config} on {gpus} GPUs ({', '.join(overrides)}), compiled with XLA's defaults and with each flag. "
              "\"Overlapped\": asynchronous collectives with at least one GEMM or attention kernel scheduled between "
              "their start and their done. Whether a flag makes the step faster needs a GPU's timing "
              "(`benchmarks/README.md`, tuning)."), "",
             "| flag | meant to | peak GiB | async collectives | overlapped | HLO lines | program |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        same = "defaults" if not r["flag"] else ("same as defaults" if r["same_program_as_defaults"] else "changed")
        lines.append(f"| `{r['flag'] or '(none)'}` | {r['purpose']} | {r['peak'] / GIB:.2f} | "
                     f"{r['async_collectives']} | {r['with_compute_between']} | {r['hlo_lines']} | {same} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
