"""The measurements of benchmarks/gpu_suite.py's steps, each run in a fresh process by the suite:

    python benchmarks/gpu_probes.py --result FILE [--smoke] environment|ceilings|mfu:<case index>

writes the step's results as JSON to FILE. Only these processes import jax and touch the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the source tree, and benchmarks/mfu.py

from gpu_suite import ALL_CASES, CASES, REPO

from jaxtron.gpu import preset as gpu_preset


def _environment(smoke: bool) -> dict:
    import jax
    import jaxlib

    out = {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
           "backend": jax.default_backend(), "device_count": jax.device_count(),
           "device_kind": jax.devices()[0].device_kind}
    stats = jax.devices()[0].memory_stats() or {}
    out["device_memory_bytes"] = stats.get("bytes_limit")
    try:
        from jax._src.lib import cuda_versions  # the CUDA plugin's version queries (None without it)
    except ImportError:
        cuda_versions = None
    for key, query in (("cudnn", "cudnn_get_version"), ("cuda_runtime", "cuda_runtime_get_version"),
                       ("cuda_driver", "cuda_driver_get_version")):
        try:
            out[key] = getattr(cuda_versions, query)() if cuda_versions is not None else None
        except (AttributeError, RuntimeError) as e:
            out[key] = f"unknown ({type(e).__name__})"
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=60, check=False)
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    out["preset_env"] = {name: os.environ.get(name) for name in gpu_preset.ENV}
    out["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    out["xla_flags_unknown"] = gpu_preset.unknown_flags(out["xla_flags"])
    out["jax_environment"] = jax.print_environment_info(return_string=True)
    return out


def _summary(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"best_s": ordered[0], "median_s": ordered[len(ordered) // 2], "repeats": len(times)}


def _ceilings(smoke: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import mfu

    from jaxtron.ops import fp8

    size = 512 if smoke else 8192
    keys = jax.random.split(jax.random.key(1), 4)
    a, b = (jax.random.normal(k, (size, size), jnp.bfloat16) for k in keys[:2])
    flops = 2 * size ** 3
    out = {"matmul_size": size}

    t = _summary(mfu.call_times(jax.jit(jnp.matmul), a, b, repeats=10))
    out["bf16_matmul"] = {**t, "tflops": flops / t["best_s"] / 1e12}

    # FP8 the way the model runs it: e4m3 operands with per-tensor scales, dequantized right before the dot,
    # which XLA's GEMM rewriter turns into one cuBLASLt FP8 GEMM on Hopper under the options the train step
    # compiles an FP8 program with
    sa, sb = (fp8.current_scale(x, fp8.E4M3) for x in (a, b))
    qa, qb = fp8.quantize(a, sa, fp8.E4M3), fp8.quantize(b, sb, fp8.E4M3)

    def fp8_matmul(qa, qb, sa, sb):
        return jnp.matmul(fp8.dequantize(qa, sa, jnp.bfloat16), fp8.dequantize(qb, sb, jnp.bfloat16))

    fn = jax.jit(fp8_matmul).lower(qa, qb, sa, sb).compile(compiler_options=fp8.compiler_options(True))
    hlo = fn.as_text()
    t = _summary(mfu.call_times(fn, qa, qb, sa, sb, repeats=10))
    out["fp8_matmul"] = {**t, "tflops": flops / t["best_s"] / 1e12,
                         "cublaslt_fp8_gemm": "__cublas$lt$matmul$f8" in hlo}

    # copy bandwidth: read and write every byte once
    n = (64 if smoke else 2048) * 2 ** 20 // 2  # bf16 elements: 2 GiB read, 2 GiB written on a GPU
    x = jax.random.normal(keys[2], (n,), jnp.bfloat16)
    t = _summary(mfu.call_times(jax.jit(lambda x: x + 1), x, repeats=10))
    out["hbm_copy"] = {**t, "bytes": 2 * x.nbytes, "tb_per_s": 2 * x.nbytes / t["best_s"] / 1e12}
    del x

    out["launch"] = _launch_probe(smoke)
    out["ragged_dot"] = _ragged_dot_probe(smoke)
    return out


def _launch_probe(smoke: bool) -> dict:
    """What one more kernel adds to a program: a chain of tiny dependent updates in place (each reads the element
    the one before wrote, so XLA can neither fuse nor reorder them), timed whole, over the kernels its program
    launches as the step's time budget counts them (``jaxtron.metrics.budget``), which adds this per kernel."""
    import jax
    import jax.numpy as jnp
    import mfu

    from jaxtron.metrics.budget import CEILINGS, kernels

    count = 50 if smoke else 300  # tracing and compiling 1,000 took 31 s on a 2-core CPU

    def chain(x, i):
        for k in range(count):
            x = jax.lax.dynamic_update_slice(x, x[(i + k) % 256][None] + 1.0, ((i + k + 1) % 256,))
        return x

    args = (jnp.ones((256,), jnp.float32), jnp.int32(0))
    fn = jax.jit(chain).lower(*args).compile()
    launched = len(kernels(fn.as_text(), CEILINGS["h100"]))
    t = _summary(mfu.call_times(fn, *args, repeats=5))
    return {**t, "kernels": launched, "seconds": t["best_s"] / max(launched, 1)}


def _ragged_dot_probe(smoke: bool) -> dict:
    """Time of ragged_dot (groups of equal size) over one dense GEMM of the same FLOPs, with XLA's defaults."""
    import jax
    import jax.numpy as jnp
    import mfu

    groups, rows, k, n = (4, 512, 128, 128) if smoke else (8, 16384, 4096, 4096)
    keys = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (groups, k, n), jnp.bfloat16)
    sizes = jnp.full((groups,), rows // groups, jnp.int32)
    dense = _summary(mfu.call_times(jax.jit(jnp.matmul), x, w[0], repeats=10))
    out = {"groups": groups, "shape": [rows, k, n], "dense_gemm_best_s": dense["best_s"]}
    # XLA's experimental ragged_dot fusion option aborted the process on the H100 target; it is timed in a process
    # of its own by benchmarks/grouped_gemm_gpu.py, so that an abort cannot take this step's ceilings with it
    variants = {"default": {}}
    for name, options in variants.items():
        try:
            fn = jax.jit(jax.lax.ragged_dot).lower(x, w, sizes).compile(compiler_options=options or None)
            t = _summary(mfu.call_times(fn, x, w, sizes, repeats=10))
            out[name] = {**t, "over_dense": t["best_s"] / dense["best_s"]}
        except Exception as e:  # noqa: BLE001  (an option this XLA lacks is a result, not a crash)
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    return out


def _attention_probe(smoke: bool) -> dict:
    """Causal attention, forward and backward, at growing lengths: cuDNN's flash kernel (XLA's whole-matrix path
    on a CPU) against jaxtron's blockwise kernel in XLA (``ops/blockwise.py``, what a sharded sequence runs), with
    their largest output difference and the rate each reaches on causal FLOPs (forward 2 x 2 x b x h x L^2 x d / 2,
    backward 2.5 times the forward)."""
    import jax
    import jax.numpy as jnp
    import mfu

    from jaxtron.ops.blockwise import blockwise_attention

    heads, kv_heads, d = (4, 2, 16) if smoke else (32, 8, 128)
    reference = "xla" if smoke else "cudnn"
    out = {"heads": heads, "kv_heads": kv_heads, "head_dim": d, "reference": reference, "lengths": {}}
    for length in ((256,) if smoke else (8192, 32768)):
        keys = jax.random.split(jax.random.key(length), 3)
        q = jax.random.normal(keys[0], (1, length, heads, d), jnp.bfloat16)
        k, v = (jax.random.normal(x, (1, length, kv_heads, d), jnp.bfloat16) for x in keys[1:])
        pos = jnp.arange(length)[None]

        def whole(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=reference)

        def blocks(q, k, v, pos=pos):
            return blockwise_attention(q, k, v, pos, pos)[0]

        flops = 3.5 * 2 * 2 * heads * length ** 2 * d / 2
        row = {}
        outputs = {}
        for name, fn in (("whole", whole), ("blockwise", blocks)):
            loss = jax.jit(jax.value_and_grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2),
                                              argnums=(0, 1, 2)))
            t = _summary(mfu.call_times(loss, q, k, v, repeats=5))
            row[name] = {**t, "tflops": flops / t["best_s"] / 1e12}
            outputs[name] = jax.jit(fn)(q, k, v).astype(jnp.float32)
        row["max_abs_difference"] = float(jnp.max(jnp.abs(outputs["whole"] - outputs["blockwise"])))
        row["blockwise_over_whole"] = row["blockwise"]["best_s"] / row["whole"]["best_s"]
        out["lengths"][str(length)] = row
    out["latent"] = _latent_attention_probe(smoke, reference)
    out["chunks"] = _chunks_probe(smoke, reference)
    return out


def _chunks_probe(smoke: bool, reference: str) -> dict:
    """One device's share of causal attention on a sequence split 8 ways (2 on a CPU), forward and backward:
    its two load-balanced chunks of queries against the whole row's keys, by the blockwise XLA kernel (what
    'auto' runs) and by cuDNN in chunks (``ops/chunked.py``, what 'cudnn' runs; the XLA kernel on a CPU), with
    their largest output difference and the rate each reaches on the shard's causal FLOPs. Which is faster
    decides what 'auto' should take on a sharded sequence."""
    import jax
    import jax.numpy as jnp
    import mfu
    import numpy as np

    from jaxtron.ops import chunked
    from jaxtron.ops.blockwise import blockwise_attention
    from jaxtron.parallel.sharding import sequence_order

    heads, kv_heads, d, shards = (4, 2, 16, 2) if smoke else (32, 8, 128, 8)
    kernel = chunked.CUDNN if reference == "cudnn" else chunked.XlaKernel()
    out = {"shards": shards, "kernel": reference, "lengths": {}}
    for length in ((256,) if smoke else (8192, 32768)):
        keys = jax.random.split(jax.random.key(length + 1), 3)
        order = sequence_order(length, shards)
        cols = slice(0, length // shards)  # shard 0: chunks 0 and 2 x shards - 1
        k_all, v_all = (jax.random.normal(x, (1, length, kv_heads, d), jnp.bfloat16) for x in keys[1:])
        q = jax.random.normal(keys[0], (1, length // shards, heads, d), jnp.bfloat16)
        pos = jnp.asarray(order[cols])[None]
        seg = jnp.ones_like(pos)

        def by_blocks(q, k_all, v_all, pos=pos, order=order):
            return blockwise_attention(q, k_all, v_all, pos, jnp.asarray(order)[None])[0]

        def by_chunks(q, k_all, v_all, pos=pos, seg=seg, cols=cols):
            return chunked.shard_attention(kernel, q, k_all[:, cols], v_all[:, cols], pos, seg, k_all, v_all,
                                           0, shards, max_segments=1)

        flops = 3.5 * 2 * 2 * heads * length ** 2 * d / 2 / shards
        row, outputs = {}, {}
        for name, fn in (("blockwise", by_blocks), ("chunks", by_chunks)):
            try:
                loss = jax.jit(jax.value_and_grad(
                    lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
                t = _summary(mfu.call_times(loss, q, k_all, v_all, repeats=5))
                row[name] = {**t, "tflops": flops / t["best_s"] / 1e12}
                outputs[name] = np.asarray(jax.jit(fn)(q, k_all, v_all).astype(jnp.float32))
            except Exception as e:  # noqa: BLE001  (a kernel that fails here is the result)
                row[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        if len(outputs) == 2:
            row["max_abs_difference"] = float(np.max(np.abs(outputs["chunks"] - outputs["blockwise"])))
            row["chunks_over_blockwise"] = row["chunks"]["best_s"] / row["blockwise"]["best_s"]
        out["lengths"][str(length)] = row
    return out


def _latent_attention_probe(smoke: bool, reference: str) -> dict:
    """DeepSeek-V3's head size (queries and keys 192; values 128, padded to 192 as jaxtron does, since
    ``jax.nn.dot_product_attention`` wants one size for all three) under the fused kernel: whether it takes it
    (jax's cuDNN path allows up to 256 on Hopper; jaxtron's choice of kernel stops at 128 until this shows it),
    its forward + backward time, and its largest difference from XLA's whole-matrix attention in float32."""
    import jax
    import jax.numpy as jnp
    import mfu

    heads, length = (4, 256) if smoke else (128, 4096)
    d = 24 if smoke else 192
    keys = jax.random.split(jax.random.key(d), 3)
    q, k, v = (jax.random.normal(x, (1, length, heads, d), jnp.bfloat16) for x in keys)
    row = {"head_dim": d, "heads": heads, "length": length, "implementation": reference}

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=reference)

    try:
        loss = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2),
                                          argnums=(0, 1, 2)))
        row.update(_summary(mfu.call_times(loss, q, k, v, repeats=5)))
        want = jax.nn.dot_product_attention(*(a.astype(jnp.float32) for a in (q, k, v)), is_causal=True,
                                            implementation="xla")
        row["max_abs_difference"] = float(jnp.max(jnp.abs(jax.jit(attend)(q, k, v).astype(jnp.float32) - want)))
    except Exception as e:  # noqa: BLE001  (a refused shape is the answer, not a crash)
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return row


def _mfu_case(smoke: bool, index: int, ceilings_file: str | None) -> dict:
    """One MFU case (``CASES`` and the variants after them), its step time beside the time budget of its own
    program at the ceilings this suite measured (the ceilings step writes them where the parent says)."""
    import mfu

    case = ALL_CASES[index]
    overrides = list(case.smoke() if smoke else case.overrides)
    measured = None
    if ceilings_file and os.path.exists(ceilings_file):
        with open(ceilings_file) as f:
            measured = json.load(f)
    row = mfu.bench_one(os.path.join(REPO, case.config), overrides, steps=10, warmup=2, ceilings=measured)
    return {"case": case.name, **row}


def _target_of_this_machine() -> str:
    """'h200' where nvidia-smi names an H200, else 'h100' (the compile-only target the predictions use)."""
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60, check=False)
        if "H200" in smi.stdout:
            return "h200"
    return "h100"


def _predictions(smoke: bool) -> dict:
    """What the H100 target predicts for each MFU case before it runs: the case's step compiled for one
    compile-only H100 (``jaxtron.planning.dry_run.on_target_in_subprocess``, in a process of its own on the CPU):
    peak memory per device, the kernels it calls and its matmul FLOPs. The MFU table sets the measured peak beside
    it. On a machine without jax's CUDA plugin each case says so. (The compiles run on the CPU, so they may share
    the machine with a GPU step.)"""
    from jaxtron.config.loader import load_config
    from jaxtron.config.schema import ConfigError
    from jaxtron.gpu import target
    from jaxtron.planning.dry_run import on_target_in_subprocess

    gpu = _target_of_this_machine()
    out = {"target": gpu, "cases": {}}
    for case in CASES[:1] if smoke else CASES:  # a smoke run checks the path with one case
        overrides = list(case.smoke() if smoke else case.overrides)
        if not target.plugin_installed():
            out["cases"][case.name] = {"error": f"jax's CUDA plugin is not installed ({target.INSTALL})"}
            continue
        try:
            got = on_target_in_subprocess(load_config(os.path.join(REPO, case.config), overrides), gpu, 1)
        except ConfigError as e:
            out["cases"][case.name] = {"error": str(e)}
            continue
        out["cases"][case.name] = {"peak_bytes": got["peak_bytes"], "kernels": got["kernels"], "flops": got["flops"],
                                   "float8_gemms": got["float8_gemms"], "compile_s": got["compile_s"],
                                   "budget": got["budget"]}
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_probes.py", description=__doc__.split("\n")[0])
    parser.add_argument("step", help=("environment, predictions, ceilings, attention or mfu:<index into "
                                      "gpu_suite.CASES>"))
    parser.add_argument("--result", required=True, help="JSON file for the results")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, for a CPU")
    parser.add_argument("--ceilings", default=None, help="mfu steps: the ceilings this suite measured (JSON)")
    args = parser.parse_args(argv)
    name, smoke = args.step, args.smoke
    if name == "environment":
        out = _environment(smoke)
    elif name == "predictions":
        out = _predictions(smoke)
    elif name == "ceilings":
        out = _ceilings(smoke)
    elif name == "attention":
        out = _attention_probe(smoke)
    elif name.startswith("mfu:"):
        out = _mfu_case(smoke, int(name.split(":")[1]), args.ceilings)
    else:
        parser.error(f"unknown step {name!r}")
    with open(args.result, "w") as f:
        json.dump(out, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


