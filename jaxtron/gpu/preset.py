"""The one preset of environment and XLA flags for GPU runs, each setting with its reason.

    eval "$(jaxtron gpu-preset)"      # export the preset (scripts/slurm/env.sh: jaxtron gpu-preset)
    jaxtron gpu-preset --check        # are the flags accepted by the installed jaxlib?

A variable already set in the environment wins over the preset, so one run can try another value. XLA flags
come and go between jaxlib releases and an unknown one aborts the process at start, so ``--check`` (and the
test suite) runs them through the installed jaxlib.

What the H100 program needs is set where it belongs, per program, with the compiled evidence
(``PROGRAM_OPTIONS``; ``tests/test_gpu_target.py`` checks each on every CI run). A process-wide flag joins
``XLA_FLAGS`` only with a GPU timing that justifies it: the candidates that change the H100 program wait for one
(``WAITING``), and those that leave it unchanged are not set (``NO_CHANGE``); ``benchmarks/preset_flags.md``
has the compiles behind both lists.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys

# variable -> (value, reason)
ENV: dict[str, tuple[str, str]] = {
    "XLA_PYTHON_CLIENT_MEM_FRACTION": (
        "0.92", ("jax preallocates 75% of GPU memory by default; the run's own memory check (check_fits) already "
                 "refuses a state that cannot fit, so the step may use almost all of it")),
    "NCCL_DEBUG": ("WARN", "NCCL prints its setup and errors once per process; INFO floods the log with every ring"),
    "PYTHONUNBUFFERED": ("1", ("output reaches the job log as it is written, so the last lines before a failure "
                               "are not lost")),
}

# --xla_flag -> (value, reason with the measurement: benchmark, before -> after)
XLA_FLAGS: dict[str, tuple[str, str]] = {}

# where an option the H100 program needs is set -> (the option, its compiled evidence)
PROGRAM_OPTIONS: dict[str, tuple[str, str]] = {
    "jaxtron/models/stack.py COMPILER_OPTIONS, with the layers in a loop (execution.scan_layers)": (
        "xla_gpu_enable_dus_accumulator_zero_init_elimination=True",
        ("Llama-3 8B (8 layers, H200 target): the zero fills of the loop's stacks, 20.4 GB, are gone; budget 439.5 "
         "-> 432.2 ms (benchmarks/step_budget.md)")),
    "jaxtron/models/tensor_chunks.py COMPILER_OPTIONS, with execution.tensor_chunks > 1 on a tensor group": (
        "xla_gpu_reduce_scatter_combine_threshold_bytes=1",
        ("Llama-3 70B (2 layers, tensor=8, 2 chunks): the chunks' reduce-scatters stay apart, 10 of 18 beside "
         "GEMMs; combined, 2 of 10 (tests/test_gpu_tensor_overlap.py)")),
    "jaxtron/ops/fp8.py COMPILER_OPTIONS, with execution.fp8": (
        "xla_gpu_enable_triton_gemm=False, xla_disable_hlo_passes=dot-merger",
        "the default model's 21 block GEMMs take float8 operands on the H100 target with them, none without"),
    "jaxtron/models/moe.py COMPILER_OPTIONS, with the experts split over devices": (
        "xla_gpu_enable_latency_hiding_scheduler=True",
        ("Mixtral 8x7B (expert=8, 4 token chunks): 18 of its 48 exchanges run beside GEMMs with it, none without; "
        "the share of their time hidden at the network's bandwidth goes from 16% to 55% (benchmarks/moe_overlap.md)")),
    "jaxtron/models/moe.py CHUNKED_OPTIONS, with the experts split over devices and execution.moe_chunks > 1": (
        "xla_gpu_experimental_parallel_collective_overlap_limit=2",
        ("Mixtral 8x7B (expert=8, 4 token chunks): 30 of its 48 exchanges beside GEMMs with two collectives in "
         "flight, 18 with one; hidden at the network's bandwidth 66% against 55% (benchmarks/moe_overlap_limit2.md)")),
    "jaxtron/gpu/target.py DEVICELESS_FLAGS, compiles without a GPU only": (
        "--xla_gpu_deviceless_cub_mode=DEVICELESS_CUB_DISABLED",
        "MoE routing's sort otherwise asks CUB for a device and XLA aborts the compile"),
}

# Flags that change the H100 program (Llama-3 8B on fsdp=8, benchmarks/preset_flags.md) and wait for a GPU's
# timing of the same step with and without them: flag -> what the compile shows
WAITING: dict[str, str] = {
    "--xla_gpu_enable_pipelined_all_gather=true": (
        "the next layer's weight gathers start in the layer before: asynchronous collectives with a GEMM or "
        "attention kernel between start and done go from 8 of 25 to 17 of 39, peak +0.16 GiB (20.30 -> 20.46)"),
    "--xla_gpu_enable_while_loop_double_buffering=true": (
        "the layer scan is unrolled by two: 17 of 40 overlapped, peak unchanged, 42% more HLO to compile"),
}

# Flags peers set that leave this jaxlib's H100 program as it is (the same optimized HLO as XLA's defaults)
NO_CHANGE = ("--xla_gpu_enable_latency_hiding_scheduler=true", "--xla_gpu_enable_pipelined_reduce_scatter=true",
             "--xla_gpu_enable_while_loop_reduce_scatter_code_motion=true")


def xla_flags() -> str:
    return " ".join(f"{flag}={value}" for flag, (value, _) in XLA_FLAGS.items())


def exports(environ: dict[str, str] | None = None) -> str:
    """Shell lines exporting the preset; variables already set keep their value (XLA_FLAGS: theirs last)."""
    environ = os.environ if environ is None else environ
    lines = []
    for name, (value, reason) in ENV.items():
        lines.append(f"# {reason}")
        lines.append(f"export {name}={shlex.quote(environ.get(name, value))}")
    flags = " ".join(f for f in (xla_flags(), environ.get("XLA_FLAGS", "")) if f)
    lines.append("# XLA flags: only those a GPU timing justified (jaxtron/gpu/preset.py); waiting for one:")
    lines += [f"#   {flag}: {why}" for flag, why in WAITING.items()]
    lines.append(f"export XLA_FLAGS={shlex.quote(flags)}")
    return "\n".join(lines)


def unknown_flags(flags: str) -> list[str]:
    """The flags of ``flags`` that the installed jaxlib rejects (it parses GPU flags on any platform)."""
    if not flags.strip():
        return []
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    unknown = re.findall(r"Unknown flags? in XLA_FLAGS: (.*)", out.stderr)
    if out.returncode != 0 and not unknown:
        raise RuntimeError(f"jax did not start with XLA_FLAGS={flags!r}: {out.stderr.strip()[-500:]}")
    return [f for line in unknown for f in line.split()]


def main(argv: list[str]) -> int:
    """`jaxtron gpu-preset [--check]`: prints the preset's exports, or checks its flags; returns the exit code."""
    parser = argparse.ArgumentParser(prog="jaxtron gpu-preset", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="check the preset's XLA flags plus $XLA_FLAGS against the installed jaxlib")
    args = parser.parse_args(argv)
    if not args.check:
        print(exports())
        return 0
    flags = " ".join(f for f in (xla_flags(), os.environ.get("XLA_FLAGS", "")) if f)
    bad = unknown_flags(flags)
    if bad:
        print(f"error: the installed jaxlib does not know {', '.join(bad)}; remove it from XLA_FLAGS or the "
              "preset (jaxtron/gpu/preset.py).", file=sys.stderr)
        return 2
    print(f"all {len(flags.split())} XLA flags are accepted by the installed jaxlib")
    return 0

