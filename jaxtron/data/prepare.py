"""Tokenize text files into a token store.

    jaxtron prepare --input 'corpus/**/*.txt' [--input 'more/*.jsonl' ...] \\
        --tokenizer byte|tokenizer.json|sp.model --output DIR [--text-field text] [--workers N] \\
        [--eos TOKEN | --no-eos] [--overwrite] [--chat [--chat-template FILE]]

Plain-text files are one document each; JSONL files hold one document per line in --text-field.
Every document ends with the tokenizer's end-of-document token (found in tokenizer.json's post-processor or
among the common names, SentencePiece's eos_id; --eos names another, --no-eos leaves it out; the byte
tokenizer has none). An existing, non-empty --output is refused unless --overwrite is given; the old store
is then replaced atomically.
Inputs are taken in sorted order and tokenized on all cores (worker processes for SentencePiece, the
multi-threaded encoder of the tokenizers library for tokenizer.json); results are written in input order, so
the same inputs always give the same store. Memory stays flat: at most a few batches are in flight.

--chat prepares conversations for supervised fine-tuning: each JSONL line holds ``messages``, rendered with the
tokenizer's chat template (or --chat-template's) as jaxtron.data.chat describes, and the store keeps a loss mask
that is 1 on the assistant's tokens only; the template goes into the manifest for generating in the same format.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import logging
import multiprocessing
import os
import sys
from collections.abc import Iterator, Sequence

import numpy as np

from jaxtron.common.files import user_path
from jaxtron.data.chat import ChatTemplate, conversation, encode_conversation, load_template
from jaxtron.data.errors import DataError
from jaxtron.data.store import StoreWriter, check_output
from jaxtron.data.tokenizers import AUTO, Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".ndjson")
LINES_PER_UNIT = 512
FILES_PER_UNIT = 32

_worker_tokenizer: Tokenizer | None = None
_worker_chat: ChatTemplate | None = None


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    files = set()
    for pattern in patterns:
        pattern = os.path.expanduser(pattern)
        if os.path.isfile(pattern):  # a plain path, even one with glob characters in it
            files.add(pattern)
            continue
        matched = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
        if not matched:
            raise DataError(f"--input '{pattern}' matches no files; check the path or quote the glob.")
        files.update(matched)
    return sorted(files)


def _units(files: list[str], text_field: str) -> Iterator[tuple[str, list, int]]:
    """Work units: (kind, payload, input bytes). Text files travel as paths, JSONL as lines of text."""
    batch, size = [], 0
    for path in files:
        if not path.endswith(JSONL_SUFFIXES):
            batch.append(path)
            size += os.path.getsize(path)
            if len(batch) == FILES_PER_UNIT:
                yield "text", batch, size
                batch, size = [], 0
            continue
        if batch:
            yield "text", batch, size
            batch, size = [], 0
        lines, nbytes = [], 0
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                lines.append((path, number, line))
                nbytes += len(line)
                if len(lines) == LINES_PER_UNIT:
                    yield "jsonl", [text_field, lines], nbytes
                    lines, nbytes = [], 0
        if lines:
            yield "jsonl", [text_field, lines], nbytes
    if batch:
        yield "text", batch, size


def _init_worker(tokenizer: Tokenizer, chat: ChatTemplate | None = None) -> None:
    global _worker_tokenizer, _worker_chat
    _worker_tokenizer, _worker_chat = tokenizer, chat


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is not UTF-8 text (byte {e.start}); convert it or leave it out.") from None


def _tokenize_unit(unit: tuple[str, list, int]) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """The unit's documents as (tokens, loss mask or None), each ending with the end-of-document token if any."""
    kind, payload, _ = unit
    if _worker_chat is not None:
        return _conversations(payload[1])
    if kind == "text":
        texts = []
        for path in payload:
            with open(path, "rb") as f:
                texts.append(_decode(f.read(), f"input file '{path}'"))
    else:
        field, lines = payload
        texts = []
        for where, record in _records(lines):
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise DataError(f"{where} has no text field '{field}'; pass the right --text-field.") from None
            texts.append(record[field])
    encode_batch = getattr(_worker_tokenizer, "encode_batch", None)
    docs = encode_batch(texts) if encode_batch else [_worker_tokenizer.encode(t) for t in texts]
    eos = _worker_tokenizer.eos_id
    if eos is None:
        return [(d, None) for d in docs]
    return [(np.append(d, np.uint32(eos)), None) for d in docs if d.size]  # empty texts stay empty: no lone EOS


def _records(lines: list) -> Iterator[tuple[str, object]]:
    """(where, parsed JSON) of each non-blank JSONL line of a unit."""
    for path, number, line in lines:
        if not line.strip():
            continue
        where = f"line {number} of '{path}'"
        try:
            yield where, json.loads(line)
        except ValueError:
            raise DataError(f"{where} is not valid JSON; fix or remove it.") from None


def _conversations(lines: list) -> list[tuple[np.ndarray, np.ndarray]]:
    docs = []
    eos = _worker_tokenizer.eos_id
    for where, record in _records(lines):
        messages = conversation(record, where)
        ids, mask = encode_conversation(_worker_tokenizer, _worker_chat, messages)
        if eos is not None:  # the document's end is not the assistant's to predict: the template's marker is
            ids, mask = np.append(ids, np.uint32(eos)), np.append(mask, np.uint8(0))
        docs.append((ids, mask))
    return docs


def prepare(inputs: Sequence[str], tokenizer: Tokenizer | str, output: str, text_field: str = "text",
            workers: int | None = None, progress: bool = False, shard_tokens: int = 1 << 28,
            dtype: str = "auto", eos: str | None = AUTO, overwrite: bool = False,
            chat: ChatTemplate | None = None) -> dict:
    """Builds the store in ``output`` and returns its manifest.

    ``eos``: "auto" (the tokenizer's own end-of-document token), a token, or None for none; used only when
    ``tokenizer`` is given by name. ``overwrite``: replace an existing, non-empty ``output``. ``chat``: read
    JSONL conversations, render them with this template and keep a loss mask on the assistant's tokens.
    """
    check_output(os.path.abspath(output), overwrite)  # before any tokenizing work
    tokenizer = load_tokenizer(tokenizer, eos) if isinstance(tokenizer, str) else tokenizer
    files = expand_inputs(inputs)
    if chat is not None:
        for path in files:
            if not path.endswith(JSONL_SUFFIXES):
                raise DataError(f"--chat reads conversations from JSONL files, and '{path}' is not one "
                                f"({', '.join(JSONL_SUFFIXES)}); pass JSONL files of {{\"messages\": [...]}} lines.")
    total = sum(os.path.getsize(p) for p in files)
    writer = StoreWriter(output, tokenizer.vocab_size, shard_tokens, dtype, overwrite)
    if workers is None:  # byte tokens cost nothing and tokenizers' Rust batch encoder already uses every core
        workers = 1 if tokenizer.kind in ("byte", "huggingface") else os.cpu_count() or 1
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing")
    try:
        units = _units(files, text_field)
        if workers == 1:
            _init_worker(tokenizer, chat)
            results = ((_tokenize_unit(u), u[2]) for u in units)
            for docs, size in results:
                for doc, mask in docs:
                    writer.add(doc, mask)
                if bar:
                    bar.update(size)
        else:
            with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tokenizer, chat)) as pool:
                pending: collections.deque = collections.deque()
                for unit in units:  # keep at most 2 units per worker in flight: memory stays flat
                    pending.append((pool.apply_async(_tokenize_unit, (unit,)), unit[2]))
                    while len(pending) >= 2 * workers:
                        _drain_one(pending, writer, bar)
                while pending:
                    _drain_one(pending, writer, bar)
        sources = [{"path": p, "bytes": os.path.getsize(p)} for p in files]
        extra = {"chat_template": chat.describe()} if chat is not None else {}
        return writer.finish(tokenizer.describe(), sources, tokenizer.eos_id, **extra)
    except BaseException:
        writer.abort()
        raise
    finally:
        if bar:
            bar.close()


def _drain_one(pending: collections.deque, writer: StoreWriter, bar) -> None:
    result, size = pending.popleft()
    for doc, mask in result.get():
        writer.add(doc, mask)
    if bar:
        bar.update(size)


def main(argv: Sequence[str]) -> int:
    """`jaxtron prepare`: writes the token store the command line ``argv`` describes."""
    from jaxtron.common.console import console_logging

    console_logging()
    parser = argparse.ArgumentParser(prog="jaxtron prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--input", action="append", required=True, help="file or glob (repeatable; ** recurses)")
    parser.add_argument("--tokenizer", required=True, help="'byte', a tokenizer.json, or a SentencePiece .model")
    parser.add_argument("--output", required=True, help="directory of the token store")
    parser.add_argument("--text-field", default="text", help="JSONL field holding the text (default: text)")
    parser.add_argument("--workers", type=int, default=None,
                        help="tokenizing processes (default: all cores for SentencePiece; one process for byte and "
                             "tokenizer.json, whose encoder is already multi-threaded)")
    parser.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file")
    parser.add_argument("--dtype", default="auto", help="token dtype: auto (smallest that fits), uint16, uint32")
    eos = parser.add_mutually_exclusive_group()
    eos.add_argument("--eos", default=AUTO, help="end-of-document token appended to every document (default: the "
                                                 "tokenizer's own; the byte tokenizer has none)")
    eos.add_argument("--no-eos", dest="eos", action="store_const", const=None,
                     help="append no end-of-document token (the model does not learn to stop)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output (atomically)")
    parser.add_argument("--chat", action="store_true", help="JSONL conversations ('messages'), rendered with the chat "
                                                            "template, loss on the assistant's tokens only")
    parser.add_argument("--chat-template", help="with --chat: a .jinja file or tokenizer_config.json to use instead "
                                                "of the tokenizer's own template")
    args = parser.parse_args(argv)
    if args.chat_template and not args.chat:
        raise DataError("--chat-template is used only with --chat; add --chat or leave it out.")
    chat = load_template(args.tokenizer, args.chat_template) if args.chat else None
    if args.workers is not None and args.workers < 1:
        raise DataError("--workers must be at least 1; pass a positive count.")
    args.output = user_path(args.output)
    manifest = prepare(args.input, args.tokenizer, args.output, args.text_field, args.workers,
                       progress=sys.stderr.isatty(), shard_tokens=args.shard_tokens, dtype=args.dtype,
                       eos=args.eos, overwrite=args.overwrite, chat=chat)
    log.info("wrote %s: %d documents, %d tokens (%s, vocabulary %d, end-of-document id %s) in %d shard(s)",
             args.output, manifest["num_documents"], manifest["num_tokens"], manifest["dtype"],
             manifest["vocab_size"], manifest["eos_id"], len(manifest["shards"]))
    return 0

