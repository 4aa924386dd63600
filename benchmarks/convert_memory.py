"""Host memory of `jaxtron convert from-hf` on a synthetic Llama, against the model's size.

    python benchmarks/convert_memory.py [--hidden 1024] [--layers 8] [--vocab 32000] [--output F.json]

Writes a random Llama-shaped Hugging Face directory (float32 safetensors), converts it in a child
process, and samples the child's anonymous resident memory (RssAnon: what cannot be paged out) every
5 ms. The disk-backed staging buffers count only as page cache, which the kernel can drop.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxtron import families
from jaxtron.interop.hf import safetensors as st


def write_model(directory: str, hidden: int, layers: int, vocab: int) -> tuple[int, int]:
    """A random Llama directory; returns (total bytes, largest tensor bytes)."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": layers,
              "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 256,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "tie_word_embeddings": False, "hidden_act": "silu"}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    plan = list(families.tensors(families.model_config(config)))
    rng = np.random.default_rng(0)
    st.write(os.path.join(directory, st.SINGLE), [(t.hf_name, t.shape, np.float32) for t in plan],
             lambda name: rng.standard_normal(next(t.shape for t in plan if t.hf_name == name), np.float32))
    sizes = [int(np.prod(t.shape)) * 4 for t in plan]
    return sum(sizes), max(sizes)


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, out_dir = os.path.join(tmp, "hf"), os.path.join(tmp, "out")
        os.makedirs(hf_dir)
        total, largest = write_model(hf_dir, args.hidden, args.layers, args.vocab)
        # the child imports everything first, reports its baseline, then converts
        code = ("import sys, time; from jaxtron.interop import convert; import jax, orbax.checkpoint; "
                "print('ready', flush=True); sys.stdin.readline(); convert.from_hf(sys.argv[1], sys.argv[2])")
        child = subprocess.Popen([sys.executable, "-c", code, hf_dir, out_dir], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True,
                                 cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        child.stdout.readline()
        time.sleep(0.5)
        baseline, peak = rss_anon(child.pid), [0]

        def sample():
            while child.poll() is None:
                try:
                    peak[0] = max(peak[0], rss_anon(child.pid))
                except OSError:
                    break
                time.sleep(0.005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        start = time.perf_counter()
        child.stdin.write("go\n")
        child.stdin.flush()
        code = child.wait()
        seconds = time.perf_counter() - start
        sampler.join()
    result = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "model_bytes": total,
              "largest_tensor_bytes": largest, "baseline_rss_anon_bytes": baseline,
              "peak_rss_anon_above_baseline_bytes": peak[0] - baseline, "seconds": seconds, "exit_code": code}
    print(json.dumps(result, indent=2))
    print(f"model {total / 2**20:.0f} MiB, largest tensor {largest / 2**20:.0f} MiB, peak anonymous memory above "
          f"baseline {(peak[0] - baseline) / 2**20:.0f} MiB ({(peak[0] - baseline) / total:.0%} of the model), "
          f"{seconds:.1f} s")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    return code


if __name__ == "__main__":
    sys.exit(main())
