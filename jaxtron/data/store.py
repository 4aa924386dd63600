"""The token store: flat token shards read by memory map, document boundaries, and a manifest.

Layout of a store directory:
  manifest.json           format, tokenizer, dtype, counts, and per shard its files, sizes and sha256
  tokens-00000.bin        the tokens of whole documents, back to back, in the manifest's dtype
  docs-00000.bin          uint64 start offsets of the shard's documents (plus the end), relative to the shard
The manifest is written last, into a directory that is renamed into place, so a store is either
complete or absent.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

import numpy as np

from jaxtron.data.errors import DataError

MANIFEST = "manifest.json"
FORMAT = 1
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def token_dtype(vocab_size: int, requested: str = "auto") -> str:
    """The smallest dtype that holds every token id, or the requested one if it does."""
    if requested not in ("auto", *DTYPES):
        raise DataError(f"token dtype '{requested}' is not one of auto, {', '.join(DTYPES)}; pass one of those.")
    for name in DTYPES if requested == "auto" else (requested,):
        if vocab_size <= np.iinfo(DTYPES[name]).max + 1:
            return name
    raise DataError(f"a vocabulary of {vocab_size} tokens does not fit the token dtype "
                    f"{'uint32' if requested == 'auto' else requested}; use --dtype auto or a larger dtype.")


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


class StoreWriter:
    """Appends documents to shards in a temporary directory; ``finish`` publishes the store atomically."""

    def __init__(self, output: str, vocab_size: int, shard_tokens: int = 1 << 28, dtype: str = "auto"):
        self.output = os.path.abspath(output)
        self.dtype = token_dtype(vocab_size, dtype)
        self.vocab_size = vocab_size
        self.shard_tokens = shard_tokens
        self.tmp = self.output + ".tmp"
        shutil.rmtree(self.tmp, ignore_errors=True)
        os.makedirs(self.tmp)
        self.shards: list[dict[str, Any]] = []
        self._open_shard()

    def _open_shard(self) -> None:
        index = len(self.shards)
        self._tokens_name, self._docs_name = f"tokens-{index:05d}.bin", f"docs-{index:05d}.bin"
        self._tokens = open(os.path.join(self.tmp, self._tokens_name), "wb")
        self._offsets = [0]

    def _close_shard(self) -> None:
        self._tokens.close()
        np.asarray(self._offsets, dtype=np.uint64).tofile(os.path.join(self.tmp, self._docs_name))
        self.shards.append({
            "tokens": self._tokens_name, "docs": self._docs_name, "num_tokens": int(self._offsets[-1]),
            "num_documents": len(self._offsets) - 1,
            "tokens_sha256": file_sha256(os.path.join(self.tmp, self._tokens_name)),
            "docs_sha256": file_sha256(os.path.join(self.tmp, self._docs_name))})

    def add(self, tokens: np.ndarray) -> None:
        """One document (empty ones are skipped)."""
        if tokens.size == 0:
            return
        if tokens.max() >= self.vocab_size:
            raise DataError(f"a token id {int(tokens.max())} is outside the tokenizer's vocabulary of "
                            f"{self.vocab_size}; the tokenizer file is inconsistent.")
        if self._offsets[-1] > 0 and self._offsets[-1] + tokens.size > self.shard_tokens:
            self._close_shard()
            self._open_shard()
        self._tokens.write(tokens.astype(DTYPES[self.dtype]).tobytes())
        self._offsets.append(self._offsets[-1] + tokens.size)

    def finish(self, tokenizer: dict, sources: list[str]) -> dict:
        self._close_shard()
        shards = [s for s in self.shards if s["num_documents"] > 0]
        manifest = {"format": FORMAT, "tokenizer": tokenizer, "vocab_size": self.vocab_size, "dtype": self.dtype,
                    "num_documents": sum(s["num_documents"] for s in shards),
                    "num_tokens": sum(s["num_tokens"] for s in shards), "sources": sources, "shards": shards}
        if manifest["num_tokens"] == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise DataError("the inputs hold no text (every document is empty); check --input and --text-field.")
        with open(os.path.join(self.tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
        if os.path.exists(self.output):
            shutil.rmtree(self.output)
        os.rename(self.tmp, self.output)
        return manifest

    def abort(self) -> None:
        self._tokens.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class TokenStore:
    """A prepared store opened for reading: one virtual token array plus document starts."""

    def __init__(self, path: str, verify: bool = True):
        self.path = path
        manifest_path = os.path.join(path, MANIFEST)
        if not os.path.isfile(manifest_path):
            raise DataError(f"'{path}' is not a prepared token store (no {MANIFEST}); create one with "
                            "python -m jaxtron.data.prepare.")
        try:
            with open(manifest_path) as f:
                self.manifest = json.load(f)
            dtype = DTYPES[self.manifest["dtype"]]
            shards = self.manifest["shards"]
            self.vocab_size = int(self.manifest["vocab_size"])
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"the manifest of store '{path}' is unreadable ({type(e).__name__}: {e}); "
                            "prepare the store again.") from None
        self.dtype = dtype
        self._tokens, starts, doc_starts = [], [0], []
        for shard in shards:
            tokens_file = os.path.join(path, shard["tokens"])
            docs_file = os.path.join(path, shard["docs"])
            for file, expected in ((tokens_file, shard["num_tokens"] * np.dtype(dtype).itemsize),
                                   (docs_file, (shard["num_documents"] + 1) * 8)):
                size = os.path.getsize(file) if os.path.isfile(file) else -1
                if size != expected:
                    raise DataError(f"shard file '{file}' has {max(size, 0)} bytes but the manifest says {expected}; "
                                    "the store is truncated or incomplete, prepare it again.")
            if verify:
                for file, key in ((tokens_file, "tokens_sha256"), (docs_file, "docs_sha256")):
                    if file_sha256(file) != shard[key]:
                        raise DataError(f"shard file '{file}' does not match its checksum in the manifest; "
                                        "the store is corrupted, prepare it again.")
            self._tokens.append(np.memmap(tokens_file, dtype=dtype, mode="r"))
            offsets = np.fromfile(docs_file, dtype=np.uint64).astype(np.int64)
            doc_starts.append(offsets[:-1] + starts[-1])
            starts.append(starts[-1] + shard["num_tokens"])
        self.shard_starts = np.asarray(starts, dtype=np.int64)
        self.doc_starts = np.concatenate(doc_starts) if doc_starts else np.zeros(0, np.int64)
        self.num_tokens = int(starts[-1])
        self.num_documents = int(self.doc_starts.size)

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows ``[s, s + length)`` for every s in ``starts``: one vectorised read per shard."""
        starts = np.asarray(starts, dtype=np.int64)
        out = np.empty((len(starts), length), dtype=self.dtype)
        first = np.searchsorted(self.shard_starts, starts, side="right") - 1
        last = np.searchsorted(self.shard_starts, starts + length - 1, side="right") - 1
        for shard in np.unique(first):
            rows = np.nonzero((first == shard) & (last == shard))[0]
            if rows.size:
                local = starts[rows] - self.shard_starts[shard]
                out[rows] = self._tokens[shard][local[:, None] + np.arange(length)]
        for row in np.nonzero(first != last)[0]:  # rows that cross a shard boundary
            out[row] = self.read(int(starts[row]), length)
        return out

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the whole store, across shard boundaries."""
        if len(self._tokens) == 1:
            return np.asarray(self._tokens[0][start:start + length])
        parts, end = [], start + length
        shard = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        while start < end:
            local = start - self.shard_starts[shard]
            take = min(end, self.shard_starts[shard + 1]) - start
            parts.append(np.asarray(self._tokens[shard][local:local + take]))
            start += take
            shard += 1
        return np.concatenate(parts)
