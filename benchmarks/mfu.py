"""Throughput and MFU of the real train step, on synthetic tokens, for one or several configs.

    python benchmarks/mfu.py configs/default.py [configs/llama3_8b.py ...] [--steps 10] [--warmup 2]
        [--output results.json] [--sweep mesh.expert=1,2,4,8] [--config.<section>.<field>=<value> ...]

Overrides apply to every config; ``--sweep FIELD=V1,V2,...`` runs every config once per value of FIELD. Each
config is compiled, warmed up, then timed step by step (each step waits for the device); the table reports the
median step time and its spread (min-max), tokens/s, model TFLOP/s per device, MFU against the dense peak, the
fraction of a matmul ceiling measured in the same process, and peak device memory where the backend reports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxtron.config.loader import load_config, split_overrides
from jaxtron.config.schema import ConfigError
from jaxtron.data.loader import SyntheticSource, global_batch
from jaxtron.gpu import preset as gpu_preset
from jaxtron.metrics.budget import budget
from jaxtron.metrics.flops import param_count
from jaxtron.metrics.throughput import Throughput
from jaxtron.ops.attention import resolve_implementation
from jaxtron.parallel.checks import check_devices
from jaxtron.parallel.mesh import make_mesh
from jaxtron.parallel.sharding import batch_sharding, shard_count
from jaxtron.planning.remat import resolve_for_devices
from jaxtron.training import state as state_lib
from jaxtron.training.preemption import StopVotes
from jaxtron.training.step import compile_train_step


def call_times(fn, *args, repeats: int = 5) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn(*args)`` after one untimed call, each waited for."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def matmul_ceiling(dtype: str, size: int, repeats: int = 5) -> float:
    """Best TFLOP/s of a square matmul on one device: what this device can do at best right now."""
    a, b = (jax.random.normal(k, (size, size), jnp.dtype(dtype)) for k in jax.random.split(jax.random.key(0)))
    return 2 * size ** 3 / min(call_times(jax.jit(jnp.matmul), a, b, repeats=repeats)) / 1e12


def peak_memory_bytes(devices) -> int | None:
    stats = [d.memory_stats() for d in devices if d.process_index == jax.process_index()]
    if not all(stats):
        return None
    return max(s.get("peak_bytes_in_use", 0) for s in stats)


def device_ceilings(device_kind: str, measured: dict | None = None):
    """The ceilings the step's time budget prices kernels at: the GPU suite's measurements of this run where given
    (``measured``: the ceilings step's result; the attention rate, which it does not measure, an H100's), else the
    stored ones of an H100 or H200; None for another device without measurements."""
    from jaxtron.metrics.budget import CEILINGS

    kind = device_kind.lower()
    stored = CEILINGS["h200"] if "h200" in kind else CEILINGS["h100"] if "h100" in kind else None
    if not measured:
        return stored
    stored = stored or CEILINGS["h100"]
    rates = {}
    if "bf16_matmul" in measured:
        rates["bf16_flops"] = measured["bf16_matmul"]["tflops"] * 1e12
    if "fp8_matmul" in measured:
        rates["fp8_flops"] = measured["fp8_matmul"]["tflops"] * 1e12
    if "hbm_copy" in measured:
        rates["copy_bytes"] = measured["hbm_copy"]["tb_per_s"] * 1e12
    if measured.get("launch", {}).get("seconds"):
        rates["launch_s"] = measured["launch"]["seconds"]
    if measured.get("attention_tflops"):
        rates["attention_flops"] = measured["attention_tflops"] * 1e12
    return dataclasses.replace(stored, **rates, source="measured in this run" + (
        "" if len(rates) == 5 else "; the rest stored"))


def bench_one(spec: str, overrides, steps: int, warmup: int, ceilings: dict | None = None) -> dict:
    """One config's timed steps; with a known GPU, the time budget of the very program that was timed
    (``jaxtron.metrics.budget``, at ``device_ceilings``) beside them."""
    cfg = load_config(spec, overrides)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source="synthetic"))
    devices = jax.devices()
    sizes = check_devices(cfg, len(devices))
    cfg = resolve_for_devices(cfg, sizes, devices)  # execution.remat='auto' as `jaxtron train` resolves it
    mesh = make_mesh(sizes, devices)
    impl = resolve_implementation(cfg.execution.attention, jnp.dtype(cfg.execution.dtype),
                                  cfg.model.qk_head_dim,
                                  shard_count(sizes, "activation_length"))
    t = cfg.train
    source = SyntheticSource(cfg.model.vocab_size, cfg.data.seq_len, t.seed)
    with jax.set_mesh(mesh):
        setup = state_lib.setup(cfg, impl)
        shardings = state_lib.state_shardings(mesh, setup.abstract_state, setup.distributed_optimizer)
        state = state_lib.init_state(cfg, impl, shardings)
        batches = [global_batch(source, i, mesh, t.global_batch_size) for i in range(min(steps + warmup, 4))]
        votes = StopVotes(mesh)(False)
        compiled, compile_s = compile_train_step(setup, shardings, batch_sharding(mesh), state, batches[0], votes)
        times = []
        for i in range(warmup + steps):
            start = time.perf_counter()
            state, metrics = compiled(state, batches[i % len(batches)], votes)
            jax.block_until_ready((state, metrics))
            if i >= warmup:
                times.append(time.perf_counter() - start)
        loss = float(metrics["loss"])
    median = float(np.median(times))
    rates = device_ceilings(devices[0].device_kind, ceilings)
    time_budget = budget(compiled.as_text(), rates).summary() if rates is not None else None
    throughput = Throughput(cfg, mesh.size, devices[0].device_kind, impl)
    result = throughput(median, 1)
    ceiling = matmul_ceiling(cfg.execution.dtype, 8192 if jax.default_backend() == "gpu" else 1024)
    if result["mfu"] is None:  # no datasheet peak (a CPU): MFU against the matmul rate measured just now
        result["mfu"], result["mfu_basis"] = result["tflops_per_device"] / ceiling, "measured matmul ceiling"
    else:
        result["mfu_basis"] = "dense datasheet peak"
    return {
        "config": spec, "overrides": [f"--config.{k}={v}" for k, v in overrides], "mesh": dict(mesh.shape),
        "dtype": cfg.execution.dtype, "precision": cfg.execution.dtype + ("+fp8" if cfg.execution.fp8 else ""),
        "attention": impl, "remat": cfg.execution.remat, "seq_len": cfg.data.seq_len,
        "global_batch_size": t.global_batch_size, "params": param_count(cfg.model), "compile_s": compile_s,
        "step_time_median_s": median, "step_time_min_s": min(times), "step_time_max_s": max(times),
        "steps_timed": len(times), "last_loss": loss, **result, "peak_note": throughput.peak_note,
        "matmul_ceiling_tflops": ceiling, "fraction_of_matmul_ceiling": result["tflops_per_device"] / ceiling,
        "peak_memory_bytes": peak_memory_bytes(devices), "budget": time_budget,
        "step_over_budget": median / time_budget["seconds"] if time_budget else None,
    }


def table(rows: list[dict]) -> str:
    head = ("config", "mesh", "precision", "seq", "batch", "step s (min-max)", "tok/s", "TFLOP/s/dev", "MFU",
            "of ceiling", "peak mem")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        mesh = "x".join(f"{k}{v}" for k, v in r["mesh"].items() if v > 1) or "1 device"
        mem = "n/a" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**30:.1f} GiB"
        mfu = f"{100 * r['mfu']:.1f}%" + ("" if r["mfu_basis"] == "dense datasheet peak" else "*")
        lines.append(" | ".join([
            os.path.basename(r["config"]), mesh, r["precision"], str(r["seq_len"]), str(r["global_batch_size"]),
            f"{r['step_time_median_s']:.4f} ({r['step_time_min_s']:.4f}-{r['step_time_max_s']:.4f})",
            f"{r['tokens_per_sec']:.4g}", f"{r['tflops_per_device']:.4g}", mfu,
            f"{100 * r['fraction_of_matmul_ceiling']:.1f}%", mem]))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    try:
        _, overrides, rest = split_overrides(argv)
        parser = argparse.ArgumentParser(prog="benchmarks/mfu.py", description=__doc__.split("\n")[0])
        parser.add_argument("configs", nargs="+", help="config files (FILE[:ARG])")
        parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
        parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling (default 2)")
        parser.add_argument("--output", default=None, help="JSON file for the full results")
        parser.add_argument("--sweep", default=None, help="FIELD=V1,V2,...: one run per value of a config field")
        args = parser.parse_args(rest)
        if args.steps < 1 or args.warmup < 0:
            raise ConfigError("--steps must be >= 1 and --warmup >= 0; pass sensible counts.")
        variants = [overrides]
        if args.sweep:
            field, _, values = args.sweep.partition("=")
            if not field or not values:
                raise ConfigError(f"--sweep {args.sweep!r} is not FIELD=V1,V2,...; write e.g. "
                                  "--sweep mesh.expert=1,2,4.")
            variants = [[*overrides, (field, v)] for v in values.split(",")]
        rows = [bench_one(spec, v, args.steps, args.warmup) for spec in args.configs for v in variants]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__)), check=False).stdout.strip() or None
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "command": " ".join([os.path.basename(sys.executable), "benchmarks/mfu.py", *argv]), "commit": commit,
              "device_kind": jax.devices()[0].device_kind, "device_count": jax.device_count(),
              "jax": jax.__version__, "python": platform.python_version(),
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "environment": {name: os.environ.get(name) for name in gpu_preset.ENV}, "results": rows}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    print(f"{report['command']}  (commit {commit}, {report['device_count']}x {report['device_kind']}, "
          f"jax {jax.__version__})")
    print("timing: median of per-step wall times after compile and warm-up, each step waited for")
    print(table(rows))
    if any(r["mfu_basis"] != "dense datasheet peak" for r in rows):
        print("* no datasheet peak for this device: MFU against the matmul ceiling measured in the same run")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
