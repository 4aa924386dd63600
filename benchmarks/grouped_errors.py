"""Where a grouped expert GEMM's numbers go wrong: each product (output, input gradient, weight gradient) of each
implementation against a float64 reference on the host, overall and group by group, for several layouts of the
group sizes (empty groups, rows past the groups, sizes on and off the kernels' 128-row tiles).

    PYTHONPATH=. python3 benchmarks/grouped_errors.py            # on a GPU: tokamax's and the Pallas FP8 kernels
    PYTHONPATH=. python3 benchmarks/grouped_errors.py --small    # on a CPU: the same code paths, small shapes

bf16 rows: 'xla' (jax.lax.ragged_dot) and 'auto' (tokamax's kernel on Hopper) against float64 of the bf16 operands.
FP8 rows: 'pallas' and 'xla' (``grouped_fp8.matmul``) against float64 of the dequantized FP8 operands (the same
quantization the module does: e4m3 rows and weights, the e5m2 output gradient), the scales in float32.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxtron.ops import fp8 as fp8_ops
from jaxtron.ops import grouped, grouped_fp8

PRODUCTS = ("output", "input gradient", "weight gradient")


def sizes_for(layout: str, groups: int, rows: int, rng: np.random.Generator) -> np.ndarray:
    if layout == "aligned":  # every group a multiple of 128 rows, none empty
        base = np.full(groups, (rows // groups) // 128 * 128)
        return base.astype(np.int32)
    weights = rng.gamma(1.0, size=groups)
    if layout in ("empty groups", "empty groups, rows past"):
        weights[rng.random(groups) < 0.3] = 0.0
        weights[0], weights[-1] = max(weights[0], 0.5), 0.0
    spare = 100 if layout.endswith("rows past") else 0
    return rng.multinomial(rows - spare, weights / weights.sum()).astype(np.int32)


def reference(x, w, sizes, ct):
    """float64 products group by group; rows past the groups give zeros."""
    x, w, ct = (np.asarray(a, np.float64) for a in (x, w, ct))
    out, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    start = 0
    for g, size in enumerate(sizes):
        s = slice(start, start + int(size))
        out[s] = x[s] @ w[g]
        dx[s] = ct[s] @ w[g].T
        dw[g] = x[s].T @ ct[s]
        start += int(size)
    return out, dx, dw


def errors(got, want, sizes):
    """(overall relative error, the worst groups as (group, start, size, error)) of each product."""
    ends = np.cumsum(sizes)
    starts = ends - sizes
    result = {}
    for name, g, v in zip(PRODUCTS, got, want, strict=True):
        g = np.asarray(g, np.float64)
        overall = float(np.linalg.norm(g - v) / max(np.linalg.norm(v), 1e-30))
        per = []
        for i, (a, b) in enumerate(zip(starts, ends, strict=True)):
            gg, vv = (g[i], v[i]) if name == "weight gradient" else (g[a:b], v[a:b])
            diff = float(np.linalg.norm(gg - vv))
            per.append((i, int(a), int(b - a), diff / max(float(np.linalg.norm(vv)), 1e-30) if b > a else diff))
        past = (float(np.abs(g[ends[-1]:]).max()) if name != "weight gradient" and ends[-1] < g.shape[0] else 0.0)
        result[name] = dict(overall=overall, worst=sorted(per, key=lambda p: -p[3])[:4], past_groups_max=past)
    return result


def _products(matmul, x, w, sizes, ct):
    y, pullback = jax.vjp(lambda a, b: matmul(a, b, sizes), x, w)
    return (y, *pullback(ct))


def run(groups, rows, k, n, interpret):
    table = []
    rng = np.random.default_rng(0)
    for layout in ("aligned", "no empty groups", "empty groups", "empty groups, rows past"):
        sizes = sizes_for(layout, groups, rows, rng)
        x, w, ct = (jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in ((rows, k), (groups, k, n), (rows, n)))
        sz = jnp.asarray(sizes)
        want = reference(x, w, sizes, ct)
        for impl in ("xla", "auto"):
            got = jax.jit(_products, static_argnums=0)(functools.partial(grouped.matmul, implementation=impl),
                                                       x, w, sz, ct)
            kind = f"bf16 {impl} -> {grouped.resolve(impl)}"
            table.append(dict(layout=layout, kind=kind, **errors(got, want, sizes)))
        # FP8: the operands as the module quantizes them, dequantized in float64 with float32 scales
        (qx, sx), (qw, sw) = fp8_ops.quantized(x, fp8_ops.E4M3), fp8_ops.quantized_per_batch(w, fp8_ops.E4M3)
        qg, sg = fp8_ops.quantized(grouped.zero_past_groups(ct, sz), fp8_ops.E5M2)
        deq = (np.asarray(qx, np.float64) * float(sx),
               np.asarray(qw, np.float64) * np.asarray(sw, np.float64)[:, None, None],
               np.asarray(qg, np.float64) * float(sg))
        want8 = reference(*deq[:2], sizes, deq[2])
        for impl in ("pallas", "xla"):
            matmul = functools.partial(grouped_fp8.matmul, implementation=impl, interpret=interpret)
            got = jax.jit(_products, static_argnums=0)(matmul, x, w, sz, ct)
            table.append(dict(layout=layout, kind=f"fp8 {impl}", **errors(got, want8, sizes)))
        for row in table[-4:]:
            cells = " | ".join(f"{row[p]['overall']:.1e}" + (f" (past {row[p]['past_groups_max']:.1e})"
                                                           if row[p]['past_groups_max'] else "") for p in PRODUCTS)
            worst = "; ".join(f"{p[:1]}: " + ", ".join(f"g{g}@{s}+{z}={e:.0e}" for g, s, z, e in row[p]["worst"][:2])
                              for p in PRODUCTS)
            print(f"| {layout} | {row['kind']} | {cells} | {worst} |", flush=True)
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="small shapes, Pallas in its interpreter (a CPU)")
    parser.add_argument("--output", help="JSON file for every number")
    args = parser.parse_args()
    shape = (4, 512, 32, 48) if args.small else (16, 4096, 512, 256)
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, groups/rows/k/n {shape}")
    print("| group sizes | kind | output | input gradient | weight gradient | worst groups (group@start+size=error) |")
    print("|---|---|---|---|---|---|")
    table = run(*shape, interpret=args.small)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, shape=shape, rows=table), f,
                      indent=1)


if __name__ == "__main__":
    main()
