"""Throughput of preparing token stores (MB/s) and of the loader (tokens/s per process); start-up time.

    python benchmarks/data.py [--seq-lens 2048,128] [--batch 64] [--steps 200] [--workers 0,2] [--output FILE]
    python benchmarks/data.py --startup [--store-gb 1] [--processes 8] [--trials 3] [--code DIR ...] [--output FILE]

The corpus is the Python standard library's source (about 11 MB here). Preparing is timed with the
byte tokenizer and with a 4096-token BPE tokenizer.json trained here on the same text, with one
worker and with all cores. The loader is timed on this process's local batches (what each process
builds before the arrays go to its devices), after a warm-up, for each sequence length and worker count.

--startup writes a synthetic store of --store-gb GB (byte tokens, uint16, documents of 1 to 4000 tokens)
under /tmp, then starts --processes processes at once, each standing for one process of a run
(jax.process_index / process_count set to its rank), and times in each, after its imports, the data
start-up: make_sources (open the store, build the train split, the unigram fact) plus the first batch
of 64 rows of 2048. The processes import first and start the clock together. Each --code DIR is a jaxtron
source tree to time (e.g. an older commit extracted with git archive), the default this one; --verify adds
data.verify=true runs. The store is deleted afterwards.
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

import jax
import numpy as np

from jaxtron.config.schema import ConfigError
from jaxtron.data.corpus import stdlib_files
from jaxtron.data.loader import BatchIterator
from jaxtron.data.packing import PackedSplit
from jaxtron.data.prepare import prepare
from jaxtron.data.store import TokenStore
from jaxtron.parallel.mesh import make_mesh


def train_bpe(files: list[str], path: str, vocab: int = 4096) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
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
    manifest = prepare(files, tokenizer, out, workers=workers, text_suffixes=(".py",))
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


STARTUP_CHILD = """
import json, os, resource, sys, time
sys.path.insert(0, sys.argv[1])
import jax
import numpy as np
from jaxtron.config.loader import from_mapping
from jaxtron.data.loader import make_sources
rank, count = int(sys.argv[3]), int(sys.argv[4])
jax.process_index, jax.process_count = (lambda: rank), (lambda: count)
cfg = from_mapping({"model": {"vocab_size": 256, "max_seq_len": 2048}, "train": {"global_batch_size": 64},
                    "data": {"source": "store", "path": sys.argv[2], "seq_len": 2048, "verify": sys.argv[5] == "1"}})
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
open(sys.argv[6] + f".ready{rank}", "w").close()
while not os.path.exists(sys.argv[6] + ".go"):  # all processes start together, after everyone's imports
    time.sleep(0.01)
start = time.perf_counter()
train = make_sources(cfg)[0]
rows = train.rows(np.arange(64))
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": seconds, "peak_rss_mb": peak / 1024, "rss_growth_mb": (peak - base) / 1024}))
"""


def write_synthetic_store(path: str, gigabytes: float) -> dict:
    from jaxtron.data.store import StoreWriter
    rng = np.random.default_rng(0)
    writer = StoreWriter(path, vocab_size=256, dtype="uint16", overwrite=True)
    total = int(gigabytes * 1e9) // 2
    written = 0
    while written < total:
        chunk = rng.integers(97, 123, 1 << 24, dtype=np.uint32)
        lengths = rng.integers(1, 4001, 1 << 14)
        cuts = np.cumsum(lengths)
        for doc in np.split(chunk, cuts[cuts < chunk.size]):
            writer.add(doc[:total - written])
            written += min(doc.size, total - written)
            if written >= total:
                break
    return writer.finish({"kind": "byte", "vocab_size": 256}, [])


def time_startup(code: str, store: str, processes: int, verify: bool) -> dict:
    """One trial: all processes at once; each reports its seconds and peak RSS."""
    gate = tempfile.mktemp(prefix="jaxtron-startup-gate-", dir="/tmp")
    children = [subprocess.Popen([sys.executable, "-c", STARTUP_CHILD, code, store, str(rank), str(processes),
                                  "1" if verify else "0", gate], stdout=subprocess.PIPE, text=True)
                for rank in range(processes)]
    while not all(os.path.exists(f"{gate}.ready{rank}") for rank in range(processes)):
        time.sleep(0.05)
    open(gate + ".go", "w").close()
    results = [json.loads(c.communicate()[0].strip().splitlines()[-1]) for c in children]
    for name in [f"{gate}.ready{rank}" for rank in range(processes)] + [gate + ".go"]:
        os.remove(name)
    seconds = [r["seconds"] for r in results]
    return {"max_seconds": max(seconds), "mean_seconds": sum(seconds) / len(seconds),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
            "rss_growth_mb": max(r["rss_growth_mb"] for r in results)}


def startup(args) -> list[dict]:
    import statistics
    store = tempfile.mkdtemp(prefix="jaxtron-startup-", dir="/tmp")
    try:
        manifest = write_synthetic_store(os.path.join(store, "s"), args.store_gb)
        print(f"store: {manifest['num_tokens']} tokens, {manifest['num_documents']} documents, "
              f"{len(manifest['shards'])} shards")
        codes = args.code or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
        runs = []
        for code in codes:
            for verify in ((False, True) if args.verify else (False,)):
                trials = [time_startup(code, os.path.join(store, "s"), args.processes, verify)
                          for _ in range(args.trials)]
                runs.append({"code": code, "verify": verify, "processes": args.processes, "trials": trials,
                             "median_max_seconds": statistics.median(t["max_seconds"] for t in trials),
                             "median_mean_seconds": statistics.median(t["mean_seconds"] for t in trials),
                             "peak_rss_mb": max(t["peak_rss_mb"] for t in trials),
                             "rss_growth_mb": max(t["rss_growth_mb"] for t in trials)})
                print(json.dumps(runs[-1]))
        return runs
    finally:
        shutil.rmtree(store, ignore_errors=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/data.py", description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", default="2048,128")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workers", default="0,2")
    parser.add_argument("--output", default=None)
    parser.add_argument("--startup", action="store_true", help="time data start-up of concurrent processes")
    parser.add_argument("--store-gb", type=float, default=1.0)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--code", action="append", help="jaxtron source tree to time (repeatable)")
    parser.add_argument("--verify", action="store_true", help="also time data.verify=true")
    args = parser.parse_args(argv)
    if args.startup:
        runs = startup(args)
        if args.output:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(os.path.abspath(__file__)), check=False).stdout.strip() or None
            with open(args.output, "w") as f:
                json.dump({"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                           "command": " ".join(["python", "benchmarks/data.py", *argv]), "commit": commit,
                           "cpus": os.cpu_count(), "startup": runs}, f, indent=2)
        return 0
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
                            cwd=os.path.dirname(os.path.abspath(__file__)), check=False).stdout.strip() or None
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
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
