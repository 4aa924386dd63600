"""Tokens/s of generation's prefill and decoding steps (``jaxtron/inference/generate.py``), compile left out.

    python benchmarks/generate.py                      # the default model and Llama-3.2 1B, on this machine
    python benchmarks/generate.py configs/X.py --batch 8 --prompt 256 --new 64 --dtype bfloat16

Each config's model with random weights (the speed does not depend on them) on one device: a batch of prompts of
``--prompt`` tokens continued greedily by ``--new`` tokens (no end-of-document stop), run twice, the second timed:
prefill tokens/s (the prompts' tokens over the prefill's time) and decode tokens/s (new tokens over the decoding
steps' time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def measure(config: str, batch: int, prompt: int, new: int, dtype: str) -> dict:
    import jax
    import numpy as np

    from jaxtron.config.loader import load_config
    from jaxtron.config.schema import ExecutionConfig
    from jaxtron.inference.generate import Generator
    from jaxtron.models import build_model

    cfg = load_config(os.path.join(ROOT, config) if not os.path.isabs(config) else config)
    model = build_model(cfg.model, ExecutionConfig(dtype=dtype, moe_mode="dropless"), 0)
    prompts = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (batch, prompt)).tolist()
    generator = Generator(model)
    start = time.perf_counter()
    generator.generate(prompts, new, cache_dtype=dtype)  # compiles
    first = time.perf_counter() - start
    result = generator.generate(prompts, new, cache_dtype=dtype)
    return dict(config=config, device=jax.devices()[0].device_kind, dtype=dtype, batch=batch, prompt=prompt, new=new,
                params=int(sum(x.size for x in jax.tree.leaves(model))), first_call_s=round(first, 3),
                prefill_tokens_per_s=result.prefill_tokens / result.prefill_s,
                decode_tokens_per_s=result.decode_tokens / result.decode_s,
                decode_step_ms=1000 * result.decode_s / max(1, result.decode_tokens // batch))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", default=["configs/default.py", "configs/llama3_1b.py"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--output", help="JSON file for the results")
    args = parser.parse_args()
    rows = [measure(c, args.batch, args.prompt, args.new, args.dtype) for c in args.configs]
    print("| config | device | dtype | params | batch x prompt + new | prefill tokens/s | decode tokens/s | "
          "decode step ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['device']} | {r['dtype']} | {r['params'] / 1e6:.1f}M | {r['batch']} x "
              f"{r['prompt']} + {r['new']} | {r['prefill_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.1f} | "
              f"{r['decode_step_ms']:.1f} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": " ".join(["python", "benchmarks/generate.py", *sys.argv[1:]]), "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
