"""What a grouped expert GEMM compiles to for the H100, without one: `jax.lax.ragged_dot` (what jaxtron's dropless
MoE calls today) and tokamax's `ragged_dot` with each implementation, forward and forward + backward, compiled for
one compile-only H100 (`jaxtron/gpu/target.py`). Mixtral 8x7B's expert shape: 8 groups, 8192 rows of 4096 into
14336.

    python benchmarks/grouped_gemm_target.py            # writes benchmarks/grouped_gemm_target.md and .json

Needs jax's CUDA plugin (``python -m pip install -e ".[gpu-target]"``) and tokamax (``python -m pip install
tokamax``; not a jaxtron dependency). tokamax's GPU kernels ask jax for the default device to pick their kernel
and refuse a CPU; a compile without a GPU has only the CPU as default device, so each compile runs in its own
process that points ``jax.extend.backend.get_default_device`` at the compile-only H100 first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
ROWS, DEPTH, WIDTH, GROUPS = 8192, 4096, 14336, 8
IMPLEMENTATIONS = ("jax.lax", "tokamax xla", "tokamax triton", "tokamax mosaic")

_ONE = """
import json, sys
import jax, jax.numpy as jnp
from jax.extend import backend
from jax.sharding import SingleDeviceSharding
from jaxtron.gpu import target
from jaxtron.metrics.hlo import matmul_flops
from jaxtron.metrics.kernels import kernels

name, rows, depth, width, groups = sys.argv[1], *map(int, sys.argv[2:6])
device = target.devices("h100", 1)[0]
backend.get_default_device = lambda: device  # tokamax picks its kernel for the default device
where = SingleDeviceSharding(device)
lhs = jax.ShapeDtypeStruct((rows, depth), jnp.bfloat16, sharding=where)
rhs = jax.ShapeDtypeStruct((groups, depth, width), jnp.bfloat16, sharding=where)
sizes = jax.ShapeDtypeStruct((groups,), jnp.int32, sharding=where)
if name == "jax.lax":
    grouped = jax.lax.ragged_dot
else:
    import tokamax
    implementation = name.split()[1]
    grouped = lambda a, b, g: tokamax.ragged_dot(a, b, g, implementation=implementation)

def both(a, b, g):
    y, pullback = jax.vjp(lambda a, b: grouped(a, b, g), a, b)
    return pullback(y)

out = {}
for part, fn, useful in (("forward", grouped, 1), ("forward+backward", both, 3)):
    compiled = jax.jit(fn).lower(lhs, rhs, sizes).compile()
    text = compiled.as_text()
    out[part] = {"kernels": kernels(text), "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                 "flops_over_useful": sum(matmul_flops(text).values()) / (useful * 2 * rows * depth * width)}
print(json.dumps(out))
"""


def compile_one(name: str) -> dict:
    from jaxtron.gpu import target

    proc = subprocess.run([sys.executable, "-c", _ONE, name, str(ROWS), str(DEPTH), str(WIDTH), str(GROUPS)],
                          env=target.environment(), capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line]
        return {"error": (lines or proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    import jax

    rows = {}
    for name in IMPLEMENTATIONS:
        rows[name] = compile_one(name)
        print(name, json.dumps(rows[name])[:400], flush=True)
    out = os.path.join(ROOT, "benchmarks", "grouped_gemm_target")
    with open(out + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    lines = ["# Grouped expert GEMMs compiled for the H100", "",
             (f"Command: `python benchmarks/grouped_gemm_target.py` (jax {jax.__version__}, compile-only H100, no "
              f"GPU): {GROUPS} groups, {ROWS} rows of {DEPTH} into {WIDTH}, bfloat16. \"counted / useful\": the "
              "matmul FLOPs counted in the compiled program (`jaxtron/metrics/hlo.py`: XLA's dots, and a grouped "
              "GEMM kernel from its shapes) over the useful ones (forward 1, forward and backward 3 ragged "
              "GEMMs)."), "",
             "| implementation | part | kernels | temporaries GiB | counted / useful |", "|---|---|---|---|---|"]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"| {name} | | {row['error']} | | |")
            continue
        for part, r in row.items():
            kernels = ", ".join(f"{k} {v}" for k, v in r["kernels"].items())
            lines.append(f"| {name} | {part} | {kernels} | {r['temp_bytes'] / 2**30:.2f} | "
                         f"{r['flops_over_useful']:.2f} |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
