"""Tokens per second of `jaxtron prepare` on a Parquet file, beside `datasets`' own `map`; peak memory by size.

    python benchmarks/prepare_formats.py [--sizes-gb 0.25,1] [--vocab 32000] [--output FILE]

For each size, the benchmark writes a Parquet file of at least that many bytes (snappy, row groups of 1000
documents, as web corpora ship). Its text is sampled: words drawn with Zipf frequencies from the
vocabulary of Python's standard library, in sentences and documents of 50 to 2000 words. A byte-level BPE
tokenizer.json of --vocab tokens is trained on a sample first. Each contender runs in a fresh process, whose
peak RSS (ru_maxrss) is read when it exits:
- `jaxtron prepare`, with the file, the tokenizer and its defaults;
- `datasets`: `load_dataset("parquet")` (which copies the file into its Arrow cache) and then `map` with
  batches of 1000, calling the same tokenizer's encode_batch_fast; once in one process (the tokenizer's threads
  use every core) and once with num_proc set to the cores.
Tokens per second count the tokens each writes, end-of-document tokens included, over its whole wall time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def vocabulary() -> list[str]:
    """The distinct words of the standard library's sources, most frequent first."""
    from jaxtron.data.corpus import stdlib_files
    counts: dict[str, int] = {}
    for path in stdlib_files()[:400]:
        with open(path, encoding="utf-8") as f:
            for word in re.findall(r"[A-Za-z][a-z]+", f.read()):
                counts[word] = counts.get(word, 0) + 1
    return sorted(counts, key=counts.get, reverse=True)


def documents(words: np.ndarray, rng: np.random.Generator, count: int) -> list[str]:
    """``count`` documents of Zipf-sampled words with sentence punctuation and paragraphs."""
    lengths = rng.integers(50, 2000, count)
    picks = np.minimum(rng.zipf(1.2, int(lengths.sum())) - 1, len(words) - 1)
    tokens = words[picks]
    marks = rng.random(tokens.size)
    tokens = np.where(marks < 0.06, np.char.add(tokens, "."), np.where(marks < 0.1, np.char.add(tokens, ","), tokens))
    docs, start = [], 0
    for length in lengths:
        text = " ".join(tokens[start:start + length].tolist())
        docs.append(text.replace(". ", ".\n\n", 1))  # a paragraph break in each document
        start += length
    return docs


def write_parquet(path: str, size_bytes: int, words: np.ndarray, seed: int = 0) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng = np.random.default_rng(seed)
    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    written = 0
    with pq.ParquetWriter(path, schema, compression="snappy") as writer:
        while os.path.getsize(path) < size_bytes:
            docs = documents(words, rng, 1000)
            writer.write_table(pa.table({"id": np.arange(written, written + len(docs)), "text": docs}, schema))
            written += len(docs)
    return written


def train_tokenizer(path: str, sample: list[str], vocab: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sample, trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=["<|endoftext|>"]))
    tok.save(path)
    return path


DATASETS_MAP = """
import os, sys, json, time
os.environ["HF_DATASETS_CACHE"] = sys.argv[3]
import datasets
from tokenizers import Tokenizer
parquet, tokenizer, cache, num_proc = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tok = Tokenizer.from_file(tokenizer)
eos = tok.token_to_id("<|endoftext|>")
def encode(batch):
    return {"input_ids": [e.ids + [eos] for e in tok.encode_batch_fast(batch["text"], add_special_tokens=False)]}
started = time.perf_counter()
ds = datasets.load_dataset("parquet", data_files=parquet, split="train", cache_dir=cache)
loaded = time.perf_counter() - started
out = ds.map(encode, batched=True, batch_size=1000, remove_columns=ds.column_names, num_proc=num_proc or None)
tokens = sum(len(ids) for part in out.iter(batch_size=10000) for ids in part["input_ids"])
print(json.dumps({"load_s": loaded, "tokens": tokens}))
"""


# Runs the command and prints its peak RSS. A process forked from this one starts with this one's resident set
# as its high-water mark, and exec keeps it; a child of this small launcher starts from the launcher's.
LAUNCHER = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:]).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
sys.exit(code)
"""


def run_child(command: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """(wall seconds, peak RSS GiB, stdout) of a command run to completion in a fresh process."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", LAUNCHER, *command], capture_output=True, text=True, env=env,
                          check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{command[:4]} failed:\n{done.stderr[-3000:]}")
    return wall, int(done.stderr.strip().splitlines()[-1]) / 2**20, done.stdout  # ru_maxrss: KiB on Linux


def contenders(parquet: str, tokenizer: str, scratch: str, peers: bool) -> dict:
    """Each contender's wall time, tokens, tokens/s and peak RSS on one file (a fresh child process each)."""
    results = {}
    store = os.path.join(scratch, "store")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    wall, peak, _ = run_child([sys.executable, "-m", "jaxtron", "prepare", "--input", parquet, "--tokenizer",
                               tokenizer, "--output", store], env)
    with open(os.path.join(store, "manifest.json")) as f:
        tokens = json.load(f)["num_tokens"]
    results["jaxtron prepare"] = {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "peak_rss_gib": peak}
    shutil.rmtree(store)
    for num_proc in (0, os.cpu_count() or 1) if peers else ():
        cache = os.path.join(scratch, "hf-cache")
        wall, peak, out = run_child([sys.executable, "-c", DATASETS_MAP, parquet, tokenizer, cache, str(num_proc)])
        found = json.loads(out.strip().splitlines()[-1])
        name = "datasets map" + (f" (num_proc={num_proc})" if num_proc else "")
        results[name] = {"wall_s": wall, "load_s": found["load_s"], "tokens": found["tokens"],
                         "tokens_per_s": found["tokens"] / wall, "peak_rss_gib": peak}
        shutil.rmtree(cache, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-gb", default="0.25,1")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--only-jaxtron-below-gb", type=float, default=0.5,
                        help="sizes below this time jaxtron alone (its memory at two sizes is the question there)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    words = np.array(vocabulary())
    scratch = tempfile.mkdtemp(prefix="prepare-bench-")
    rows = []
    try:
        tokenizer = train_tokenizer(os.path.join(scratch, "tokenizer.json"),
                                    documents(words, np.random.default_rng(1), 3000), args.vocab)
        for size in (float(s) for s in args.sizes_gb.split(",")):
            parquet = os.path.join(scratch, f"web-{size}gb.parquet")
            docs = write_parquet(parquet, int(size * 1e9), words)
            row = {"size_gb": os.path.getsize(parquet) / 1e9, "documents": docs}
            row["results"] = contenders(parquet, tokenizer, scratch, peers=size >= args.only_jaxtron_below_gb)
            rows.append(row)
            print(json.dumps(row, indent=1), flush=True)
            os.remove(parquet)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    record = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "command": "python " + " ".join(sys.argv), "vocab": args.vocab, "rows": rows}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
