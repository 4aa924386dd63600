"""Compiled memory and collectives of cuDNN by chunks on a sharded sequence (``ops/chunked.py``), beside the
blockwise kernel that 'auto' runs, for Llama-3.2 1B on one sequence group of 8 fake CPU devices.

cuDNN does not compile on a CPU, so the chunk path is compiled with the same calls in XLA (``chunked.XlaKernel``)
in cuDNN's place: the program's structure (the gathered row in token order, each chunk's rolled copy, the merge)
is the GPU's, the kernels' own working memory is XLA's (float32 key and value gradients where cuDNN's are 16-bit).

    python benchmarks/chunks_dry_run.py --out benchmarks/chunks_dry_run_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from plan_validation import GIB, _commit

LENGTHS = (8192, 32768, 131072)


def compile_one(length: int, implementation: str) -> dict:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.path.insert(0, ROOT)
    from jaxtron.config.loader import load_config
    from jaxtron.ops import chunked
    from jaxtron.planning.dry_run import dry_run

    chunked.CUDNN = chunked.XlaKernel()
    cfg = load_config(os.path.join(ROOT, "configs", "llama3_1b.py"), [
        ("data.seq_len", str(length)), ("model.max_seq_len", str(length)), ("train.global_batch_size", "8"),
        ("train.logit_chunks", str(length // 4096)), ("mesh.sequence", "8"), ("mesh.fsdp", "1")])
    r = dry_run(cfg, implementation=implementation)
    return dict(seq_len=length, attention=implementation, peak=r.peak_bytes, arguments=r.argument_bytes,
                temp=r.temp_bytes, collectives=r.collectives)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "chunks_dry_run_cpu.json"))
    parser.add_argument("--one", nargs=2, metavar=("LENGTH", "ATTENTION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # one compile per process: XLA:CPU keeps what it compiled
        print(json.dumps(compile_one(int(args.one[0]), args.one[1])))
        return 0
    commit = _commit()
    rows = []
    for length in LENGTHS:
        for attention in ("blockwise", "cudnn"):
            proc = subprocess.run([sys.executable, __file__, "--one", str(length), attention], capture_output=True,
                                  text=True, check=True)
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            gathers = row["collectives"].get("all-gather", {}).get("bytes", 0)
            print(f"seq {length:>6} {attention:>9}: peak {row['peak'] / GIB:6.2f} GiB ({row['arguments'] / GIB:.2f}"
                  f" + {row['temp'] / GIB:.2f}), all-gathers {gathers / 2**20:.0f} MiB", flush=True)
            rows.append(row)
    import jax
    with open(args.out, "w") as f:
        json.dump({"commit": commit, "jax": jax.__version__, "command": "python benchmarks/chunks_dry_run.py",
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
