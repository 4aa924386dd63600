"""Throughput of preparing token stores (MB/s) and of the loader (tokens/s per process).

    python benchmarks/data.py [--seq-lens 2048,128] [--batch 64] [--steps 200] [--workers 0,2] [--output FILE]

The corpus is the Python standard library's source (about 11 MB here). Preparing is timed with the
byte tokenizer and with a 4096-token BPE tokenizer.json trained here on the same text, with one
worker and with all cores. The loader is timed on this process's local batches (what each process
builds before the arrays go to its devices), after a warm-up, for each sequence length and worker count.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from jaxtron.config import ConfigError  # noqa: E402
from jaxtron.data.corpus import stdlib_files  # noqa: E402
from jaxtron.data.loader import BatchIterator  # noqa: E402
from jaxtron.data.packing import PackedSplit  # noqa: E402
from jaxtron.data.prepare import prepare  # noqa: E402
from jaxtron.data.store import TokenStore  # noqa: E402
from jaxtron.mesh import make_mesh  # noqa: E402


def train_bpe(files: list[str], path: str, vocab: int = 4096) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                         show_progress=False))
    tok.save(path)
    return path


def time_prepare(files, tokenizer, workers, scratch) -> dict:
    out = os.path.join(scratch, f"store-{os.path.basename(str(tokenizer))}-{workers}")
    start = time.perf_counter()
    manifest = prepare(files, tokenizer, out, workers=workers)
    seconds = time.perf_counter() - start
    megabytes = sum(os.path.getsize(f) for f in files) / 1e6
    return {"tokenizer": os.path.basename(str(tokenizer)), "workers": workers, "seconds": seconds,
            "input_mb": megabytes, "mb_per_s": megabytes / seconds, "tokens": manifest["num_tokens"],
            "tokens_per_s": manifest["num_tokens"] / seconds, "store": out}


def time_loader(store_path: str, seq_len: int, batch: int, steps: int, workers: int) -> dict:
    store = TokenStore(store_path)
    split = PackedSplit(store, seq_len, "train", 0.05, seed=0)
    mesh = make_mesh(dict(data=1, fsdp=1, sequence=1, expert=1, tensor=1), jax.devices()[:1])
    iterator = BatchIterator(split, mesh, batch, workers=workers)
    for _ in range(5):  # warm-up: workers started, pages touched
        iterator.next_local()
    start = time.perf_counter()
    for _ in range(steps):
        local = iterator.next_local()
    seconds = time.perf_counter() - start
    iterator.close()
    tokens = steps * local["inputs"].size
    return {"seq_len": seq_len, "batch": batch, "workers": workers, "steps": steps, "seconds": seconds,
            "tokens_per_s": tokens / seconds}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/data.py", description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", default="2048,128")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    files = stdlib_files()
    scratch = tempfile.mkdtemp(prefix="jaxtron-data-bench-")
    try:
        bpe = train_bpe(files, os.path.join(scratch, "bpe4096.json"))
        prepares = [time_prepare(files, tok, w, scratch) for tok in ("byte", bpe) for w in (1, os.cpu_count())]
        byte_store = prepares[0]["store"]
        loads = [time_loader(byte_store, int(s), args.batch, args.steps, int(w))
                 for s in args.seq_lens.split(",") for w in args.workers.split(",")]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", "benchmarks/data.py", *argv]), "commit": commit,
              "cpus": os.cpu_count(), "python": platform.python_version(), "prepare": prepares, "loader": loads}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    print(f"{report['command']}  (commit {commit}, {os.cpu_count()} CPUs)")
    print("prepare | tokenizer | workers | input MB | seconds | MB/s | tokens/s")
    for p in prepares:
        print(f"prepare | {p['tokenizer']} | {p['workers']} | {p['input_mb']:.1f} | {p['seconds']:.2f} | "
              f"{p['mb_per_s']:.1f} | {p['tokens_per_s']:.3g}")
    print("loader | seq_len | batch | workers | tokens/s per process")
    for r in loads:
        print(f"loader | {r['seq_len']} | {r['batch']} | {r['workers']} | {r['tokens_per_s']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
