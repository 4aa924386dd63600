"""The token store: flat token shards read by memory map, document boundaries, and a manifest.

Layout of a store directory:
  manifest.json           format, tokenizer, end-of-document id, dtype, counts, and per shard its files, sizes, sha256
  tokens-00000.bin        the tokens of whole documents, back to back, in the manifest's dtype
  docs-00000.bin          uint64 start offsets of the shard's documents (plus the end), relative to the shard
  mask-00000.bin          (format 3, conversations) uint8 per token: 1 where the token is a target that carries
                          loss (what the assistant wrote), 0 elsewhere
  records.jsonl           (prompt stores, for RL) the record each document was made from, one JSON line each
Format 2 ends every document with the tokenizer's end-of-document token (``eos_id``; null for the byte
tokenizer, which has none). Format 1 stores (no ``eos_id``, no end-of-document tokens) still load.
The manifest is written last, into a directory that is renamed into place, so a store is either
complete or absent.

Opening a store checks the manifest and every file's size; hashing every shard against the manifest
is a separate, explicit step (``TokenStore.verify``, or ``jaxtron verify-data DIR``), because
it reads the whole corpus. Document offsets stay memory-mapped per shard: a process holds no copy of them.
"""

from __future__ import annotations

import argparse
import array
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jaxtron.data.errors import DataError
from jaxtron.data.staging import WRITER_LOCK, claim_writer_dir

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
RECORDS = "records.jsonl"
FORMAT = 3  # the newest format read; stores without a loss mask are written as format 2, which older readers take
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


def first_manifest(data_path: str) -> dict:
    """The manifest of the first token store ``data.path`` names ({} when it names none, or that store is not
    there)."""
    for store in (data_path.split(",") if data_path else []):
        manifest = os.path.join(os.path.expanduser(store.strip()), MANIFEST)
        if os.path.isfile(manifest):
            with open(manifest) as f:
                return json.load(f)
    return {}


def check_output(output: str, overwrite: bool) -> None:
    """Refuses to prepare into an existing, non-empty path unless ``overwrite``."""
    if overwrite or not os.path.lexists(output):
        return
    if os.path.isdir(output) and not os.path.islink(output) and not os.listdir(output):
        return
    raise DataError(f"--output '{output}' already exists and is not empty; pass --overwrite to replace it "
                    "or choose another directory.")


class StoreWriter:
    """Appends documents to shards in a temporary directory; ``finish`` publishes the store atomically."""

    def __init__(self, output: str, vocab_size: int, shard_tokens: int = 1 << 28, dtype: str = "auto",
                 overwrite: bool = False):
        self.output = os.path.abspath(output)
        check_output(self.output, overwrite)
        self.dtype = token_dtype(vocab_size, dtype)
        self.vocab_size = vocab_size
        self.shard_tokens = shard_tokens
        self.overwrite = overwrite
        self.tmp, self._lock = claim_writer_dir(self.output)
        self.shards: list[dict[str, Any]] = []
        self.masked: bool | None = None  # whether documents come with loss masks: all of them or none
        self._records, self._records_digest, self._record_count = None, hashlib.sha256(), 0
        self._open_shard()

    def _open_shard(self) -> None:
        index = len(self.shards)
        self._tokens_name, self._docs_name = f"tokens-{index:05d}.bin", f"docs-{index:05d}.bin"
        self._tokens = open(os.path.join(self.tmp, self._tokens_name), "wb")  # noqa: SIM115 (open while the shard fills)
        self._digest = hashlib.sha256()  # hashed while written: no second pass over the shard
        self._offsets = array.array("Q", [0])  # 8 bytes per document, not a Python int object each
        self._mask_name = f"mask-{index:05d}.bin"
        self._mask = None
        self._mask_digest = hashlib.sha256()

    def _close_shard(self) -> None:
        self._tokens.close()
        offsets = np.frombuffer(self._offsets, dtype=np.uint64).astype("<u8")
        offsets.tofile(os.path.join(self.tmp, self._docs_name))
        shard = {"tokens": self._tokens_name, "docs": self._docs_name, "num_tokens": int(self._offsets[-1]),
                 "num_documents": len(self._offsets) - 1, "tokens_sha256": self._digest.hexdigest(),
                 "docs_sha256": hashlib.sha256(offsets.tobytes()).hexdigest()}
        if self._mask is not None:
            self._mask.close()
            shard.update(mask=self._mask_name, mask_sha256=self._mask_digest.hexdigest())
        self.shards.append(shard)

    def add(self, tokens: np.ndarray, mask: np.ndarray | None = None, record: str | None = None) -> None:
        """One document (empty ones are skipped), with its loss mask (1 on tokens that are trained on) if the
        store has them: every document of a store has one, or none does. ``record``: the JSON text it was made
        from, kept in ``records.jsonl`` (a prompt store's, for the reward function)."""
        if tokens.size == 0:
            return
        if record is not None:
            if self._records is None:
                self._records = open(os.path.join(self.tmp, RECORDS), "wb")  # noqa: SIM115 (open while adding)
            line = (record + "\n").encode()
            self._records.write(line)
            self._records_digest.update(line)
            self._record_count += 1
        if self.masked is None:
            self.masked = mask is not None
        if self.masked != (mask is not None) or mask is not None and mask.shape != tokens.shape:
            raise ValueError("every document of a store needs a loss mask of its own length, or none does")
        if tokens.max() >= self.vocab_size:
            raise DataError(f"a token id {int(tokens.max())} is outside the tokenizer's vocabulary of "
                            f"{self.vocab_size}; the tokenizer file is inconsistent.")
        if self._offsets[-1] > 0 and self._offsets[-1] + tokens.size > self.shard_tokens:
            self._close_shard()
            self._open_shard()
        data = tokens.astype(np.dtype(DTYPES[self.dtype]).newbyteorder("<")).tobytes()
        self._tokens.write(data)
        self._digest.update(data)
        self._offsets.append(self._offsets[-1] + tokens.size)
        if mask is not None:
            if self._mask is None:
                self._mask = open(os.path.join(self.tmp, self._mask_name), "wb")  # noqa: SIM115
            data = np.asarray(mask, np.uint8).tobytes()
            self._mask.write(data)
            self._mask_digest.update(data)

    def finish(self, tokenizer: dict, sources: list[str], eos_id: int | None = None, **extra: Any) -> dict:
        """Publishes the store; ``extra`` goes into the manifest too (a conversation store's chat template)."""
        self._close_shard()
        if self._records is not None:
            self._records.close()
            extra["records"] = {"file": RECORDS, "sha256": self._records_digest.hexdigest(),
                                "count": self._record_count}
        shards = [s for s in self.shards if s["num_documents"] > 0]
        manifest = {"format": FORMAT if self.masked else 2, "tokenizer": tokenizer, "vocab_size": self.vocab_size,
                    "dtype": self.dtype, "eos_id": eos_id, "num_documents": sum(s["num_documents"] for s in shards),
                    "num_tokens": sum(s["num_tokens"] for s in shards), "sources": sources, "shards": shards,
                    "loss_mask": bool(self.masked), **extra}
        if manifest["num_tokens"] == 0:
            self._release()
            raise DataError("the inputs hold no text (every document is empty); check --input and --text-field.")
        with open(os.path.join(self.tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
        os.remove(os.path.join(self.tmp, WRITER_LOCK))  # not part of the store; the lock is held until the rename
        try:
            check_output(self.output, self.overwrite)  # another writer may have published here meanwhile
        except DataError:
            self._release()
            raise
        if os.path.lexists(self.output):
            # rename the old store aside first: the path always holds a complete store, old or new
            old = self.output + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(self.output, old)
            os.rename(self.tmp, self.output)
            if os.path.isdir(old) and not os.path.islink(old):
                shutil.rmtree(old)
            else:
                os.remove(old)
        else:
            os.rename(self.tmp, self.output)
        self._lock.close()
        return manifest

    def abort(self) -> None:
        self._tokens.close()
        if self._records is not None:
            self._records.close()
        if self._mask is not None:
            self._mask.close()
        self._release()

    def _release(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._lock.close()


class TokenStore:
    """A prepared store opened for reading: one virtual token array plus memory-mapped document starts.

    Opening checks the manifest and every file's size; ``verify`` (or ``verify=True`` here) also hashes
    the shards against the manifest's SHA-256.
    """

    def __init__(self, path: str, verify: bool = False):
        self.path = path
        manifest_path = os.path.join(path, MANIFEST)
        if not os.path.isfile(manifest_path):
            raise DataError(f"'{path}' is not a prepared token store (no {MANIFEST}); create one with "
                            "jaxtron prepare.")
        try:
            with open(manifest_path) as f:
                self.manifest = json.load(f)
            fmt = int(self.manifest.get("format", 1))
            dtype = DTYPES[self.manifest["dtype"]]
            self.shards = list(self.manifest["shards"])
            self.vocab_size = int(self.manifest["vocab_size"])
            eos = self.manifest.get("eos_id")
            self.eos_id = None if eos is None else int(eos)
            kind = self.manifest.get("tokenizer", {}).get("kind")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataError(f"the manifest of store '{path}' is unreadable ({type(e).__name__}: {e}); "
                            "prepare the store again.") from None
        if fmt > FORMAT:
            raise DataError(f"store '{path}' has format {fmt}, newer than the format {FORMAT} this jaxtron reads; "
                            "update jaxtron or prepare the store with this version.")
        if fmt < 2 and kind in ("huggingface", "sentencepiece"):  # byte tokens have no end-of-document id anyway
            log.warning("store %s (format %d) has no end-of-document tokens: a model trained on it does not learn "
                        "where documents end; prepare it again to add them", path, fmt)
        self.format, self.dtype = fmt, dtype
        self.has_loss_mask = bool(self.manifest.get("loss_mask"))
        self._tokens, self._docs, self._masks, starts, doc_counts = [], [], [], [0], [0]
        for shard in self.shards:
            tokens_file = os.path.join(path, shard["tokens"])
            docs_file = os.path.join(path, shard["docs"])
            files = [(tokens_file, shard["num_tokens"] * np.dtype(dtype).itemsize),
                     (docs_file, (shard["num_documents"] + 1) * 8)]
            if self.has_loss_mask:
                files.append((os.path.join(path, shard.get("mask", "missing-mask")), shard["num_tokens"]))
            for file, expected in files:
                size = os.path.getsize(file) if os.path.isfile(file) else -1
                if size != expected:
                    raise DataError(f"shard file '{file}' has {max(size, 0)} bytes but the manifest says {expected}; "
                                    "the store is truncated or incomplete, prepare it again.")
            self._tokens.append(np.memmap(tokens_file, dtype=dtype, mode="r"))
            self._docs.append(np.memmap(docs_file, dtype="<u8", mode="r"))
            if self.has_loss_mask:
                self._masks.append(np.memmap(os.path.join(path, shard["mask"]), dtype=np.uint8, mode="r"))
            starts.append(starts[-1] + shard["num_tokens"])
            doc_counts.append(doc_counts[-1] + shard["num_documents"])
        self.shard_starts = np.asarray(starts, dtype=np.int64)  # token index where each shard begins
        self.shard_docs = np.asarray(doc_counts, dtype=np.int64)  # document index where each shard begins
        self.num_tokens = int(starts[-1])
        self.num_documents = int(doc_counts[-1])
        if verify:
            self.verify()

    def verify(self, shards: Iterable[int] | None = None) -> None:
        """Hashes shards ``shards`` (default: all) and refuses any that differ from the manifest's SHA-256."""
        for i in range(len(self.shards)) if shards is None else shards:
            shard = self.shards[i]
            names = [(shard["tokens"], "tokens_sha256"), (shard["docs"], "docs_sha256")]
            if self.has_loss_mask:
                names.append((shard["mask"], "mask_sha256"))
            for name, key in names:
                file = os.path.join(self.path, name)
                if file_sha256(file) != shard[key]:
                    raise DataError(f"shard file '{file}' does not match its checksum in the manifest; "
                                    "the store is corrupted, prepare it again.")
        records = self.manifest.get("records")
        if records and shards is None and file_sha256(os.path.join(self.path, records["file"])) != records["sha256"]:
            raise DataError(f"the records of store '{self.path}' do not match their checksum in the manifest; the "
                            "store is corrupted, prepare it again.")

    def _by_shard(self, index: np.ndarray, bounds: np.ndarray, dtype, read) -> np.ndarray:
        """``read(shard, local index)`` for the entries of ``index`` in each shard, assembled in ``index``'s shape.
        ``bounds`` are where shards begin (``shard_starts`` for token positions, ``shard_docs`` for documents);
        an index at the very end belongs to the last shard."""
        index = np.asarray(index, dtype=np.int64)
        shard = np.minimum(np.searchsorted(bounds, index, side="right") - 1, len(self.shards) - 1)
        out = np.empty(index.shape, dtype)
        for s in np.unique(shard):
            chosen = shard == s
            out[chosen] = read(s, index[chosen] - bounds[s])
        return out

    def doc_index(self, positions: np.ndarray) -> np.ndarray:
        """The index of the document holding each token position (same shape as ``positions``)."""
        return self._by_shard(positions, self.shard_starts, np.int64, lambda s, local: self.shard_docs[s] - 1 +
                              np.searchsorted(self._docs[s], local.astype(np.uint64), side="right"))  # no map copy

    def doc_start(self, documents: np.ndarray) -> np.ndarray:
        """The token position where each document begins; document ``num_documents`` gives the end."""
        return self._by_shard(documents, self.shard_docs, np.int64,
                              lambda s, local: self.shard_starts[s] + self._docs[s][local].astype(np.int64))

    def take_mask(self, positions: np.ndarray) -> np.ndarray:
        """The loss mask (1: trained on) at store positions ``positions``; all ones for a store without masks."""
        if not self.has_loss_mask:
            return np.ones(np.shape(positions), np.uint8)
        return self._by_shard(positions, self.shard_starts, np.uint8, lambda s, local: self._masks[s][local])

    def take(self, positions: np.ndarray) -> np.ndarray:
        """The tokens at store positions ``positions`` (any shape), read shard by shard."""
        return self._by_shard(positions, self.shard_starts, self.dtype, lambda s, local: self._tokens[s][local])

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
        return parts[0] if len(parts) == 1 else np.concatenate(parts)  # inside one shard: a view, no copy


def main(argv: Sequence[str]) -> int:
    """`jaxtron verify-data STORE_DIR [STORE_DIR ...]`: checks every shard of the stores against their SHA-256."""
    parser = argparse.ArgumentParser(prog="jaxtron verify-data", description="Hash every shard of token stores "
                                     "against their manifests (this reads the whole corpus).")
    parser.add_argument("stores", nargs="+", metavar="STORE_DIR", help="a directory written by jaxtron prepare")
    args = parser.parse_args(argv)
    from jaxtron.common.console import console_logging

    console_logging()
    for path in args.stores:
        store = TokenStore(path, verify=True)
        log.info("%s: %d shard(s), %d documents, %d tokens match the manifest", path, len(store.shards),
                 store.num_documents, store.num_tokens)
    return 0

