"""The MoE configs' train steps compiled for compile-only H100s, before and after the grouped expert GEMM: dropless
experts on ``jax.lax.ragged_dot`` with the padded exchange (what every MoE step compiled to before), on tokamax's
grouped GEMM with the ragged exchange (``auto``, what a Hopper GPU now runs), FP8 projections on top of it, and
capacity mode.

    python benchmarks/moe_target.py                  # writes benchmarks/moe_target.md and .json (about 20 minutes)
    python benchmarks/moe_target.py --rows mixtral   # the rows whose name starts so
    python benchmarks/moe_target.py --variants "the same, FP8"   # these variants only (the others are kept)

Per device and step: XLA's peak memory and temporaries, matmul FLOPs counted in the program (``metrics/hlo.py``:
dots, library GEMMs, attention and grouped GEMM kernels from their shapes) over the model's (recompute included),
the bytes of the all-to-all exchanges, and the kernels. Needs jax's CUDA plugin and tokamax
(``python -m pip install -e ".[gpu-target]"``); each compile runs in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BASE = ["execution.dtype=bfloat16", "data.seq_len=4096", "train.logit_chunks=8"]
ROWS = {  # name -> (config, GPUs, overrides)
    "mixtral_8x7b 1/32 layers, expert=1, 1 GPU": (
        "mixtral_8x7b", 1, ["model.num_layers=1", "train.global_batch_size=4", "mesh.expert=1"]),
    "mixtral_8x7b 4/32 layers, expert=8, 8 GPUs": (
        "mixtral_8x7b", 8, ["model.num_layers=4", "train.global_batch_size=16", "mesh.fsdp=1", "mesh.expert=8"]),
    "qwen3_30b_a3b 4/48 layers, expert=8, 8 GPUs": (
        "qwen3:30b-a3b", 8, ["model.num_layers=4", "train.global_batch_size=16", "mesh.fsdp=1", "mesh.expert=8"]),
    "deepseek_v3 4/61 layers (1 MoE), expert=64, 64 GPUs in 8 nodes": (
        "deepseek_v3", 64, ["model.num_layers=4", "train.global_batch_size=64", "mesh.fsdp=1", "mesh.expert=64"]),
}
VARIANTS = {  # name -> overrides
    "dropless, ragged_dot, padded exchange (before)": ["execution.moe_mode=dropless", "execution.expert_gemm=xla",
                                                      "execution.moe_exchange=padded"],
    "dropless, grouped GEMM, ragged exchange": ["execution.moe_mode=dropless", "execution.expert_gemm=auto"],
    "the same, receive factor 1.25": ["execution.moe_mode=dropless", "execution.expert_gemm=auto",
                                      "execution.moe_receive_factor=1.25"],
    "the same, FP8": ["execution.moe_mode=dropless", "execution.expert_gemm=auto",
                      "execution.moe_receive_factor=1.25", "execution.fp8=True"],
    "capacity 1.25": ["execution.moe_mode=capacity"],
    "capacity 1.25, FP8": ["execution.moe_mode=capacity", "execution.fp8=True"],
}


def config_path(config: str) -> str:
    name, _, arg = config.partition(":")
    return os.path.join(ROOT, "configs", f"{name}.py") + (f":{arg}" if arg else "")


def routed_bytes(cfg, gpus: int) -> float:
    """Bytes of the rows one exchange of a device moves when only the routed rows travel: tokens x k rows of the
    hidden width in the compute dtype."""
    import jax.numpy as jnp

    rows = cfg.train.global_batch_size * cfg.data.seq_len / gpus * cfg.model.moe.experts_per_token
    return rows * cfg.model.embed_dim * jnp.dtype(cfg.execution.dtype).itemsize


def largest_exchange(hlo: str) -> float:
    """Bytes of the largest all-to-all of the program (ragged: what it may move, ``metrics/collectives.py``)."""
    from jaxtron.metrics.collectives import collective_bytes
    from jaxtron.metrics.hlo import definitions

    defined = definitions(hlo)
    return max((collective_bytes(line, defined) for line in hlo.splitlines()
                if any(f" {kind}{end}(" in line for kind in ("all-to-all", "ragged-all-to-all")
                       for end in ("", "-start"))), default=0.0)


def compile_one(config: str, gpus: int, overrides: list[str]) -> dict:
    from jaxtron.config.loader import load_config
    from jaxtron.config.schema import ConfigError
    from jaxtron.metrics.flops import hardware_flops_per_token
    from jaxtron.planning.dry_run import on_target_in_subprocess

    cfg = load_config(config_path(config), [tuple(o.split("=", 1)) for o in overrides])
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        try:
            got = on_target_in_subprocess(cfg, "h100", gpus, hlo_path=os.path.join(folder, "step.hlo"),
                                          timeout_s=1500)
        except ConfigError as e:
            return {"error": str(e), "seconds": round(time.monotonic() - start, 1)}
        with open(os.path.join(folder, "step.hlo")) as f:
            largest = largest_exchange(f.read())
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    model = hardware_flops_per_token(cfg.model, cfg.execution, cfg.data.seq_len) * tokens / gpus
    exchanges = [got["collectives"].get(kind, {"count": 0, "bytes": 0}) for kind in ("all-to-all", "ragged-all-to-all")]
    return {"peak_bytes": got["peak_bytes"], "temp_bytes": got["temp_bytes"], "flops": got["flops"],
            "model_flops": model, "all_to_all_bytes": sum(e["bytes"] for e in exchanges),
            "ragged_all_to_all_bytes": exchanges[1]["bytes"], "all_to_all_count": sum(e["count"] for e in exchanges),
            "largest_exchange_bytes": largest, "routed_bytes": routed_bytes(cfg, gpus),
            "kernels": got["kernels"], "float8_gemms": got["float8_gemms"], "compile_s": got["compile_s"],
            "seconds": round(time.monotonic() - start, 1)}


def _ratio(bytes_: float, routed: float) -> str:
    return f"{bytes_ / routed:.2f}" if bytes_ else "none"


def markdown(results: dict) -> str:
    from jaxtron.metrics.kernels import describe

    lines = [("| model and mesh | experts run as | peak GiB | temporaries GiB | compiled / model FLOPs | "
             "all-to-all MiB a step | largest exchange / routed rows | kernels |"), "|---|---|---|---|---|---|---|---|"]
    for row, variants in results.items():
        for variant, r in variants.items():
            if "error" in r:
                lines.append(f"| {row} | {variant} | {r['error'][:200]} | | | | | |")
                continue
            lines.append(f"| {row} | {variant} | {r['peak_bytes'] / 2**30:.1f} | {r['temp_bytes'] / 2**30:.1f} | "
                         f"{r['flops'] / r['model_flops']:.2f} | {r['all_to_all_bytes'] / 2**20:.0f} | "
                         f"{_ratio(r['largest_exchange_bytes'], r['routed_bytes'])} | "
                         f"{describe(r['kernels'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/moe_target.py", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="", help="only the rows whose name starts with this")
    parser.add_argument("--variants", default="", help="only these variants, separated by ';'")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "moe_target"),
                        help="path of the results without extension (.md and .json are written)")
    args = parser.parse_args(argv)
    rows = {k: v for k, v in ROWS.items() if k.startswith(args.rows)}
    if not rows:
        print(f"error: --rows {args.rows!r} matches none of: {', '.join(ROWS)}.", file=sys.stderr)
        return 2
    variants = {k: v for k, v in VARIANTS.items() if not args.variants or k in args.variants.split(";")}
    if not variants:
        print(f"error: --variants {args.variants!r} names none of: {'; '.join(VARIANTS)}.", file=sys.stderr)
        return 2
    results: dict = {}
    if os.path.exists(args.out + ".json"):  # what was not asked for this time is kept
        with open(args.out + ".json") as f:
            results = {row: {v: r for v, r in done.items() if row not in rows or v not in variants}
                       for row, done in json.load(f)["results"].items()}
    for row, (config, gpus, overrides) in rows.items():
        results.setdefault(row, {})
        for variant, extra in variants.items():
            results[row][variant] = compile_one(config, gpus, BASE + overrides + extra)
            print(row, "|", variant, "|", json.dumps(results[row][variant])[:300], flush=True)
            with open(args.out + ".json", "w") as f:
                json.dump({"command": "python benchmarks/moe_target.py " + " ".join(argv), "results": results}, f,
                          indent=1)
    results = {k: {v: results[k][v] for v in VARIANTS if v in results[k]} for k in ROWS if k in results}
    with open(args.out + ".md", "w") as f:
        f.write(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
