"""Expert GEMMs on a GPU: each grouped GEMM implementation against one dense bf16 GEMM of the same useful FLOPs.

    PYTHONPATH=. python3 benchmarks/grouped_gemm_gpu.py --out DIR            # on the GPU machine
    PYTHONPATH=. python3 benchmarks/grouped_gemm_gpu.py --out DIR --smoke    # the same code paths on a CPU

The shapes are the up-projection of one device's experts in the MoE configs (rows = tokens x top-k routed to the
device, split over its local experts by random group sizes with some groups empty, as a router makes them):
Mixtral 8x7B on expert=1 (8 groups, 4096 -> 14336), Qwen3-30B-A3B on expert=8 (16 of its 128 experts,
2048 -> 768) and DeepSeek-V3 on expert=8 (32 of its 256 experts, 7168 -> 2048). Each implementation runs in a
process of its own (an XLA option that aborts takes only its own row with it): ``jax.lax.ragged_dot`` as XLA
compiles it, the same with ``xla_gpu_experimental_use_ragged_dot_fusion``, tokamax's ``ragged_dot`` with its
Triton and Mosaic GPU kernels, and what jaxtron's dropless experts call (``ops/grouped.py`` with 'auto': tokamax's
kernels with jaxtron's backward; with FP8, ``ops/grouped_fp8.py``), beside one dense GEMM in bf16 and in FP8.
Each is checked against a float32 reference computed group by group (relative
Frobenius error of the output and of both gradients), then timed forward and forward + backward (median of 10
after a warm-up); TFLOP/s count the useful FLOPs only (2 x rows x K x N forward, three times that with both
gradients), so an implementation that expands the groups densely shows it as a lower rate. DIR receives
``grouped_gemm_gpu.json``; the table is printed last. Wheels for tokamax: ``scripts/gpu_wheels.sh``.
``--sweep`` times tokamax's Mosaic GPU kernel with each tile configuration of ``SWEEP`` instead: the rate a tuned
configuration reaches against the dense GEMM, which decides whether tuning tokamax's kernel reaches 80% of it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

# name: (groups, rows, K, N)
SHAPES = {"mixtral_8x7b expert=1": (8, 16384, 4096, 14336),
          "qwen3_30b_a3b expert=8": (16, 32768, 2048, 768),
          "deepseek_v3 expert=8": (32, 32768, 7168, 2048)}
SMOKE_SHAPES = {"tiny": (4, 256, 64, 128), "tiny, many groups": (16, 256, 32, 64)}
IMPLEMENTATIONS = ("dense", "dense fp8", "jax.lax", "jax.lax ragged_dot_fusion", "tokamax triton", "tokamax mosaic",
                   "jaxtron", "jaxtron fp8")
SMOKE_IMPLEMENTATIONS = ("dense", "dense fp8", "jax.lax", "tokamax xla", "jaxtron", "jaxtron fp8")
# --sweep: tokamax's Mosaic GPU kernel with each of these tile configurations (block_m, block_n, block_k, pipeline
# stages), beside the dense GEMM and the kernel as tokamax configures it. The compile for the H100 target shows the
# configuration tokamax picks without a GPU to tune on: 64 x 64 tiles with 128-deep steps and 2 stages.
SWEEP = ((64, 64, 128, 2), (64, 128, 64, 4), (128, 128, 64, 4), (128, 128, 128, 3), (128, 256, 64, 3),
         (64, 256, 64, 4), (128, 64, 128, 4), (128, 256, 128, 2))


def group_sizes(rng, groups: int, rows: int):
    """Random sizes summing to ``rows``: uneven (gamma-weighted) with about one group in eight empty, at least one
    group left non-empty."""
    import numpy as np

    weights = rng.gamma(1.0, size=groups)
    weights[rng.random(groups) < 0.125] = 0.0
    if not weights.any():
        weights[0] = 1.0
    return rng.multinomial(rows, weights / weights.sum()).astype(np.int32)


def _implementation(name: str):
    import jax
    import jax.numpy as jnp

    if name.startswith("dense"):
        return None
    if name.startswith("jaxtron"):  # what a dropless MoE block calls: ops/grouped.py (and its FP8 form)
        from jaxtron.ops import grouped as ops_grouped
        from jaxtron.ops import grouped_fp8

        if name.endswith("fp8"):
            return lambda x, w, s: grouped_fp8.matmul(x, w, s, ops_grouped.resolve("auto", fp8=True))
        return lambda x, w, s: ops_grouped.matmul(x, w, s, "auto")
    if name.startswith("jax.lax"):
        return jax.lax.ragged_dot
    try:
        import tokamax
    except ModuleNotFoundError as e:
        if e.name != "xprof":
            raise
        # tokamax imports xprof's kernel-statistics tool for its own profiling helpers, which this benchmark does
        # not call; a placeholder module lets its kernels load where xprof is not installed
        import types
        stub = types.ModuleType("xprof.cli.tools.get_kernel_stats_tool")
        for parent in ("xprof", "xprof.cli", "xprof.cli.tools"):
            sys.modules.setdefault(parent, types.ModuleType(parent))
        sys.modules["xprof.cli.tools"].get_kernel_stats_tool = stub
        sys.modules[stub.__name__] = stub
        import tokamax

    kind, *tiles = name.split()[1:]
    if tiles:  # "tokamax mosaic 128x256x64/3": that tile configuration (--sweep)
        from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu

        (bm, bn, bk), stages = map(int, tiles[0].split("/")[0].split("x")), int(tiles[0].split("/")[1])
        op = pallas_mosaic_gpu.PallasMosaicGpuRaggedDot(config=pallas_mosaic_gpu.Config(
            block_m=bm, block_n=bn, block_k=bk, num_stages=stages, split_k=1))
        return lambda x, w, s: op(x, w, group_sizes=s, preferred_element_type=jnp.bfloat16)
    return lambda x, w, s: tokamax.ragged_dot(x, w, s, implementation=kind, preferred_element_type=jnp.bfloat16)


def measure(name: str, smoke: bool) -> dict:
    """One implementation over every shape: errors against float32, then forward and forward + backward times."""
    import jax
    import jax.numpy as jnp
    import mfu
    import numpy as np

    from jaxtron.ops import fp8 as fp8_ops

    grouped = _implementation(name)
    options = {"xla_gpu_experimental_use_ragged_dot_fusion": True} if "ragged_dot_fusion" in name else None
    if name == "dense fp8":  # with the options under which XLA makes it a cuBLASLt FP8 GEMM (ops/fp8.py)
        options = fp8_ops.compiler_options(True)
    rng = np.random.default_rng(7)
    out = {"implementation": name, "device": jax.devices()[0].device_kind, "jax": jax.__version__, "shapes": {}}
    for shape_name, (groups, rows, k, n) in (SMOKE_SHAPES if smoke else SHAPES).items():
        sizes = group_sizes(rng, groups, rows)
        keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
        x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
        w = (jax.random.normal(keys[1], (groups, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        ct = jax.random.normal(keys[2], (rows, n), jnp.bfloat16)
        s = jnp.asarray(sizes)
        useful = 2 * rows * k * n
        row: dict = {"groups": groups, "rows": rows, "k": k, "n": n, "empty_groups": int((sizes == 0).sum()),
                     "largest_group": int(sizes.max()), "useful_tflop_forward": useful / 1e12}
        if name == "dense fp8":  # the same in FP8 as the dense projections run it
            def forward(x, w, s):
                return fp8_ops.einsum("mk,kn->mn", x, w[0])
        elif grouped is None:  # one dense GEMM of the same useful FLOPs: the rate to beat
            def forward(x, w, s):
                return x @ w[0]
        else:
            def forward(x, w, s):
                return grouped(x, w, s)

        def both(x, w, s, ct):
            y, pullback = jax.vjp(lambda x, w: forward(x, w, s), x, w)
            return y, *pullback(ct)
        try:
            fwd = jax.jit(forward).lower(x, w, s).compile(compiler_options=options)
            fb = jax.jit(both).lower(x, w, s, ct).compile(compiler_options=options)
            if not name.startswith("dense"):
                row["relative_error"] = _errors(fb(x, w, s, ct), x, w, ct, sizes)
            for part, fn, args, flops in (("forward", fwd, (x, w, s), useful),
                                          ("forward+backward", fb, (x, w, s, ct), 3 * useful)):
                times = sorted(mfu.call_times(fn, *args, repeats=10))
                median = times[len(times) // 2]
                row[part] = {"median_s": median, "best_s": times[0], "tflops": flops / median / 1e12}
        except Exception as e:  # noqa: BLE001  (a kernel that refuses a shape is this row's result)
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        out["shapes"][shape_name] = row
    return out


def _errors(got, x, w, ct, sizes) -> dict:
    """Relative Frobenius error of the output and both gradients against float32 products group by group (one
    compiled program: each group's rows taken as a window of the largest group's size and masked)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    window = int(sizes.max())
    starts = jnp.asarray(np.cumsum(sizes) - sizes, jnp.int32)
    hi = jax.lax.Precision.HIGHEST

    @jax.jit
    def squared(got_y, got_dx, got_dw, x, w, ct, sizes, starts):
        pad = lambda a: jnp.pad(a.astype(jnp.float32), ((0, window), (0, 0)))
        x, ct, got_y, got_dx = pad(x), pad(ct), pad(got_y), pad(got_dx)

        def one(g):
            take = lambda a: jax.lax.dynamic_slice_in_dim(a, starts[g], window)
            mask = (jnp.arange(window) < sizes[g])[:, None]
            xg, ctg = jnp.where(mask, take(x), 0), jnp.where(mask, take(ct), 0)
            wg = w[g].astype(jnp.float32)
            want = (jnp.matmul(xg, wg, precision=hi), jnp.matmul(ctg, wg.T, precision=hi),
                    jnp.matmul(xg.T, ctg, precision=hi))
            have = (jnp.where(mask, take(got_y), 0), jnp.where(mask, take(got_dx), 0), got_dw[g].astype(jnp.float32))
            return jnp.stack([jnp.sum((h - v) ** 2) for h, v in zip(have, want, strict=True)]), \
                jnp.stack([jnp.sum(v ** 2) for v in want])
        diff, norm = jax.lax.map(one, jnp.arange(w.shape[0]))
        return diff.sum(0), norm.sum(0)

    diff, norm = (np.asarray(a, np.float64) for a in squared(*got, x, w, ct, jnp.asarray(sizes), starts))
    rel = np.sqrt(diff / np.maximum(norm, 1e-30))
    return dict(zip(("output", "lhs_grad", "rhs_grad"), map(float, rel), strict=True))


def markdown(results: list[dict]) -> str:
    dense = next((r for r in results if r.get("implementation") == "dense"), {})
    lines = [(f"Device: {next((r['device'] for r in results if 'device' in r), 'unknown')}; jax "
             f"{next((r['jax'] for r in results if 'jax' in r), '?')}. Useful FLOPs only; 'of dense': the rate over "
             "one dense bf16 GEMM of the same useful FLOPs."), "",
             ("| implementation | shape (groups, rows, K, N; empty) | forward TFLOP/s | of dense | fwd+bwd TFLOP/s | "
             "of dense | largest relative error (out, dlhs, drhs) |"), "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r and "shapes" not in r:
            lines.append(f"| {r['implementation']} | {r['error'][:200]} | | | | | |")
            continue
        for shape_name, row in r["shapes"].items():
            dims = f"{shape_name}: {row['groups']}, {row['rows']}, {row['k']}, {row['n']}; {row['empty_groups']}"
            if "error" in row:
                lines.append(f"| {r['implementation']} | {dims} | {row['error'][:200]} | | | | |")
                continue
            base = dense.get("shapes", {}).get(shape_name, {})
            cells = []
            for part in ("forward", "forward+backward"):
                rate = row[part]["tflops"]
                ref = base.get(part, {}).get("tflops")
                cells += [f"{rate:.4g}", f"{rate / ref:.2f}" if ref else "n/a"]
            err = row.get("relative_error")
            err_cell = ", ".join(f"{v:.1e}" for v in err.values()) if err else "(reference)"
            lines.append(f"| {r['implementation']} | {dims} | {' | '.join(cells)} | {err_cell} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/grouped_gemm_gpu.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for grouped_gemm_gpu.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on a CPU")
    parser.add_argument("--box", type=float, default=90.0, help="seconds each implementation's process may take")
    parser.add_argument("--only", help="comma-separated implementations to run (default: all)")
    parser.add_argument("--sweep", action="store_true", help="tokamax's Mosaic GPU kernel with each tile configuration")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child: one implementation, JSON to stdout
    args = parser.parse_args(argv)
    if args.one:
        sys.argv[1:] = []  # tokamax reads absl flags from the command line, which are not its own here
        print("RESULT " + json.dumps(measure(args.one, args.smoke)))
        return 0
    os.makedirs(args.out, exist_ok=True)
    results = []
    names = SMOKE_IMPLEMENTATIONS if args.smoke else IMPLEMENTATIONS
    if args.only:
        names = [n.strip() for n in args.only.split(",")]
    if args.sweep:
        names = ["dense", "tokamax mosaic", *(f"tokamax mosaic {m}x{n}x{k}/{s}" for m, n, k, s in SWEEP)]
    for name in names:
        start = time.monotonic()
        cmd = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--one", name,
               *(["--smoke"] if args.smoke else [])]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.box, check=False)
            found = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if found:
                results.append(json.loads(found[-1]))
            else:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                results.append({"implementation": name, "error": f"exit code {proc.returncode}: {tail[:300]}"})
        except subprocess.TimeoutExpired:
            results.append({"implementation": name, "error": f"stopped after {args.box:.0f} s"})
        results[-1]["seconds"] = round(time.monotonic() - start, 1)
        with open(os.path.join(args.out, "grouped_gemm_gpu.json"), "w") as f:
            json.dump(results, f, indent=2)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
