"""Compiled peak memory per device under context parallelism, beside the planner's estimate of the same program.

Llama-3.2 1B on 8 fake CPU devices, sequence lengths 8k, 32k and 128k, mesh.sequence = 1, 2, 4, 8 with fsdp over
the rest and one row per data-parallel rank (so each sequence is cut over ``sequence`` devices, and a device holds
seq_len / sequence tokens). Attention is blockwise (flash-style) on every row: on a GPU an unsharded sequence runs
cuDNN's kernel, which holds no score matrix either; the CPU compiles the XLA one. The loss runs in slices of 4096
tokens (``train.logit_chunks``).

    python benchmarks/context_parallel.py                 # compile all, write benchmarks/context_parallel.md/.json
    python benchmarks/context_parallel.py --estimate-only # re-estimate the compiled numbers of the .json

One subprocess per compile (``plan_validation.compile_one``).
"""

from __future__ import annotations

import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)
from plan_validation import GIB, TOLERANCE, _commit, arguments, compile_one, estimate_of

LENGTHS = (8192, 32768, 131072)
SEQUENCE = (1, 2, 4, 8)
DEVICES = 8


def overrides(length: int, sequence: int) -> list[str]:
    return [f"data.seq_len={length}", f"train.global_batch_size={DEVICES // sequence}", f"mesh.sequence={sequence}",
            f"mesh.fsdp={DEVICES // sequence}", "execution.attention=blockwise",
            f"train.logit_chunks={length // 4096}"]


def main() -> int:
    args = arguments(__doc__, "context_parallel.md")
    stored = os.path.splitext(args.out)[0] + ".json"
    compiled = {}
    if args.estimate_only:
        with open(stored) as f:
            old = json.load(f)
        compiled = {(r["seq_len"], r["sequence"]): r for r in old["rows"]}
    rows = []
    for length in LENGTHS:
        for sequence in SEQUENCE:
            over = overrides(length, sequence)
            est = estimate_of("llama3_1b", DEVICES, over)[1]
            before = compiled.get((length, sequence))
            got = before["compiled"] if before else compile_one("llama3_1b", DEVICES, over)
            commit = before["commit"] if before else _commit()
            error = est.memory_bytes / got["peak"] - 1
            rows.append(dict(seq_len=length, sequence=sequence, overrides=over, commit=commit, compiled=got,
                             estimated=est.memory_bytes, estimated_terms=est.memory, error=error))
            print(f"seq {length:>6} sequence={sequence}: compiled {got['peak'] / GIB:6.2f} GiB, estimated "
                  f"{est.memory_bytes / GIB:6.2f} GiB ({100 * error:+.1f}%)", flush=True)
    write(args.out, rows)
    return 0


def write(path: str, rows: list[dict]) -> None:
    import jax

    inside = sum(abs(r["error"]) <= TOLERANCE for r in rows)
    commits = ", ".join(sorted({r["commit"] for r in rows}))
    lines = [
        "# Context parallelism: compiled memory per device",
        "",
        (f"Command: `python benchmarks/context_parallel.py` (compiled at commit {commits}, jax {jax.__version__}, "
        f"{platform.machine()} CPU, {DEVICES} fake devices). Llama-3.2 1B, bfloat16 compute, remat full, blockwise "
        "attention, one row per data-parallel rank (global batch 8 / sequence), fsdp over the other devices, loss "
        "in slices of 4096 tokens. Compiled: XLA's peak per device (arguments + temporaries). Estimated: "
        "`estimate(cfg, mesh, cpu_program=True)`."),
        "",
        f"{inside} of {len(rows)} estimates are within {TOLERANCE:.0%} of the compiled peak.",
        "",
        "| seq_len | sequence | fsdp | tokens/device | compiled GiB (args + temp) | estimated GiB | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["compiled"]
        lines.append(f"| {r['seq_len']} | {r['sequence']} | {DEVICES // r['sequence']} | "
                     f"{r['seq_len'] // r['sequence']} | {c['peak'] / GIB:.2f} ({c['arguments'] / GIB:.2f} + "
                     f"{c['temp'] / GIB:.2f}) | {r['estimated'] / GIB:.2f} | {100 * r['error']:+.1f}% |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
