"""Tokenize a corpus into a token store.

    jaxtron prepare --input 'corpus/**/*.parquet' [--input more/ ...] [--dataset DIR_OR_BUILDER ...] \\
        --tokenizer byte|tokenizer.json|sp.model|MODEL_DIR --output DIR [--text-field a.b | --template T] \\
        [--workers N] [--eos TOKEN | --no-eos] [--overwrite] [--chat | --pairs | --prompts] [--chat-template F]

jaxtron.data.sources says which files are read and in what order. A text file is one document; a record
(a JSON line, a Parquet or Arrow row, a dataset's row) is one document, from --text-field or --template.
Every document ends with the tokenizer's end-of-document token (jaxtron.data.tokenizers says where it is
found); --eos names another, --no-eos leaves it out. An existing, non-empty --output is refused unless
--overwrite is given. The store is written beside --output and renamed into place once complete, so a killed
prepare leaves no store, and the same command run again writes it.
Results are written in input order, so the same documents give the same store from any format. Tokenizing
runs on all cores (worker processes for SentencePiece, the tokenizers library's threads for tokenizer.json,
fed by a reading thread). Memory stays flat: at most a few batches are in flight.

--chat prepares conversations for supervised fine-tuning: each record holds ``messages``, rendered with the
tokenizer's chat template (or --chat-template's) as jaxtron.data.chat describes, and the store keeps a loss mask
that is 1 on the assistant's tokens only; the template goes into the manifest for generating in the same format.
--pairs prepares chosen/rejected pairs for DPO the same way, two documents a record (jaxtron.data.pairs);
--prompts, RL's prompts with their records for the reward function (jaxtron.data.prompts).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import multiprocessing
import os
import sys
from collections.abc import Iterator, Sequence

import numpy as np

from jaxtron.common.files import user_path
from jaxtron.data import tables
from jaxtron.data.chat import ChatTemplate, conversation, encode_conversation, load_template
from jaxtron.data.errors import DataError
from jaxtron.data.hf_datasets import DatasetInput, dataset_batches
from jaxtron.data.pairs import encode_pair
from jaxtron.data.prompts import encode_prompt
from jaxtron.data.records import RecordText
from jaxtron.data.sources import (
    TEXT_SUFFIXES,
    Source,
    expand_inputs,
    prefetched,
    read_bytes,
    read_lines,
    suffixes,
)
from jaxtron.data.store import StoreWriter, check_output
from jaxtron.data.tokenizers import AUTO, Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

LINES_PER_UNIT = 1024
FILES_PER_UNIT = 32

_worker_tokenizer: Tokenizer | None = None
_worker_chat: ChatTemplate | None = None
_worker_text: RecordText | None = None
_worker_kind = ""  # records: "chat" (conversations), "pairs" (DPO) or "prompts" (RL); "": text
PROMPT_COLUMNS = ("prompt",)
RECORD_COLUMNS = {"chat": ("messages",), "pairs": ("prompt", "chosen", "rejected"), "prompts": PROMPT_COLUMNS}
RECORD_FLAGS = {columns: f"--{kind}" for kind, columns in RECORD_COLUMNS.items()}

# A unit of work: (kind, input's path, index of its first item, items, input bytes). Kinds: "files" (text
# Sources), "lines" (raw JSON lines; index = line number), "records" (dicts), "texts" (strings or None).
Unit = tuple[str, str, int, list, int]


class Where:
    """Names a record in an error ("line 3 of 'a.jsonl'"); built as text only when an error needs it."""

    __slots__ = ("index", "label", "path")

    def __init__(self, label: str, path: str, index: int):
        self.label, self.path, self.index = label, path, index

    def __str__(self) -> str:
        return f"{self.label} {self.index} of {self.path}"


def _units(sources: list[Source], datasets: Sequence[DatasetInput], text: RecordText,
           records: tuple[str, ...] | None) -> Iterator[Unit]:
    """The work units of every input, in input order, then row order; ``records``: the columns of a conversation
    or pair record (None: text from ``text``)."""
    columns = records or text.columns
    flat = text.flat and not records
    every = records == PROMPT_COLUMNS  # a prompt's record reaches the reward function whole: every column
    files: list[Source] = []
    size = 0
    for source in sources:
        if source.kind == "text":
            files.append(source)
            size += os.path.getsize(source.path)
            if len(files) == FILES_PER_UNIT:
                yield "files", "", 0, files, size
                files, size = [], 0
            continue
        if files:
            yield "files", "", 0, files, size
            files, size = [], 0
        if source.kind == "json":
            yield from _json_units(source)
        else:
            yield from _table_units(source, None if every else columns, flat)
    if files:
        yield "files", "", 0, files, size
    for spec in datasets:
        row = 0
        for batch in dataset_batches(spec, columns, every):
            count = len(batch[columns[0]])
            items = batch[columns[0]] if flat else [dict(zip(batch, values, strict=True))
                                                    for values in zip(*batch.values(), strict=True)]
            yield "texts" if flat else "records", f"dataset '{spec.path}'", row, items, 0
            row += count


def _json_units(source: Source) -> Iterator[Unit]:
    """JSON lines in units of LINES_PER_UNIT; a .json file holding one array, as records."""
    where = f"'{source.path}'"
    lines, nbytes, first = [], 0, 1
    for number, line in enumerate(read_lines(source), 1):
        if number == 1 and suffixes(os.path.basename(source.path))[0] == ".json" \
                and line.lstrip().startswith(b"["):  # a .json file holding one array: read as a whole
            yield from _json_array(source, line)
            return
        lines.append(line)
        nbytes += len(line)
        if len(lines) == LINES_PER_UNIT:
            yield "lines", where, first, lines, nbytes
            lines, nbytes, first = [], 0, number + 1
    if lines:
        yield "lines", where, first, lines, nbytes


def _json_array(source: Source, first_line: bytes) -> Iterator[Unit]:
    data = read_bytes(source)
    try:
        records = json.loads(data)
    except ValueError as e:
        raise DataError(f"'{source.path}' starts like a JSON array but is not valid JSON ({e}); fix the file, or "
                        "write one record per line.") from None
    del data
    for start in range(0, len(records), LINES_PER_UNIT):
        yield "records", f"'{source.path}'", start + 1, records[start:start + LINES_PER_UNIT], 0


def _table_units(source: Source, columns: Sequence[str] | None, flat: bool) -> Iterator[Unit]:
    row = 1
    for batch, nbytes in tables.batches(source, columns):
        items = batch.column(0).to_pylist() if flat else batch.to_pylist()
        yield "texts" if flat else "records", f"'{source.path}'", row, items, nbytes
        row += batch.num_rows


def check_tables(sources: list[Source], text: RecordText, records: tuple[str, ...] | None) -> None:
    """Opens every Parquet and Arrow input's schema: a damaged file or a missing column is refused up front."""
    for source in sources:
        if source.kind not in ("parquet", "arrow"):
            continue
        schema = tables.schema(source)
        for column in records or ():
            tables.check_columns(source, schema, (column,), RECORD_FLAGS[records])
        if records:
            continue
        for column in text.columns if text.template else [text.path]:
            path = (column,) if isinstance(column, str) else column
            tables.check_columns(source, schema, path, "--template" if text.template else "--text-field")
        if text.flat:
            tables.check_text_type(source, schema, text.path[0])


def _init_worker(tokenizer: Tokenizer, chat: ChatTemplate | None = None, text: RecordText | None = None,
                 kind: str = "") -> None:
    global _worker_tokenizer, _worker_chat, _worker_text, _worker_kind
    _worker_tokenizer, _worker_chat, _worker_text, _worker_kind = tokenizer, chat, text or RecordText(), kind


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is not UTF-8 text (byte {e.start}); convert it or leave it out.") from None


def _unit_records(unit: Unit) -> Iterator[tuple[Where, object]]:
    """(where, record) of each record of a "lines" or "records" unit; blank JSON lines are skipped."""
    kind, path, first, items, _ = unit
    label = "line" if kind == "lines" else "row"
    for i, item in enumerate(items):
        where = Where(label, path, first + i)
        if kind != "lines":
            yield where, item
            continue
        if not item.strip():
            continue
        try:
            yield where, json.loads(item)
        except ValueError:
            raise DataError(f"{where} is not valid JSON; fix or remove it.") from None


def _tokenize_unit(unit: Unit) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """The unit's documents as (tokens, loss mask or None), each ending with the end-of-document token if any."""
    kind, _, _, items, _ = unit
    if _worker_chat is not None:
        return _conversations(_unit_records(unit))
    if kind == "files":
        texts = [_decode(read_bytes(s), f"input file '{s.path}'") for s in items]
    elif kind == "texts":
        texts = items
    else:
        texts = [_worker_text.text(record, where) for where, record in _unit_records(unit)]
    texts = [t for t in texts if t]  # null and empty texts are no document: no lone end-of-document token
    encode_batch = getattr(_worker_tokenizer, "encode_batch", None)
    docs = encode_batch(texts) if encode_batch else [_worker_tokenizer.encode(t) for t in texts]
    eos = _worker_tokenizer.eos_id
    if eos is None:
        return [(d, None) for d in docs]
    return [(np.append(d, np.uint32(eos)), None) for d in docs if d.size]


def _conversations(records: Iterator[tuple[Where, object]]) -> list[tuple[np.ndarray, np.ndarray]]:
    docs = []
    eos = _worker_tokenizer.eos_id
    for where, record in records:
        if _worker_kind == "pairs":
            docs += encode_pair(_worker_tokenizer, _worker_chat, record, str(where))
            continue
        if _worker_kind == "prompts":
            ids, line = encode_prompt(_worker_tokenizer, _worker_chat, record, str(where))
            docs.append((ids, None, line))
            continue
        messages = conversation(record, str(where))
        ids, mask = encode_conversation(_worker_tokenizer, _worker_chat, messages)
        if eos is not None:  # the document's end is not the assistant's to predict: the template's marker is
            ids, mask = np.append(ids, np.uint32(eos)), np.append(mask, np.uint8(0))
        docs.append((ids, mask))
    return docs


def prepare(inputs: Sequence[str], tokenizer: Tokenizer | str, output: str, text_field: str = "text",
            workers: int | None = None, progress: bool = False, shard_tokens: int = 1 << 28,
            dtype: str = "auto", eos: str | None = AUTO, overwrite: bool = False,
            chat: ChatTemplate | None = None, template: str | None = None, split: str | None = None,
            text_suffixes: Sequence[str] = TEXT_SUFFIXES, datasets: Sequence[DatasetInput] = (),
            kind: str = "") -> dict:
    """Builds the store in ``output`` and returns its manifest.

    ``eos``: "auto" (the tokenizer's own end-of-document token), a token, or None for none; used only when
    ``tokenizer`` is given by name. ``overwrite``: replace an existing, non-empty ``output``. ``chat``: read
    conversations (``messages``), render them with this template and keep a loss mask on the assistant's tokens.
    ``kind``: with ``chat``, "pairs" reads chosen/rejected pairs (``jaxtron.data.pairs``), two documents a record;
    "prompts" reads RL's prompts and keeps their records (``jaxtron.data.prompts``).
    ``template``: jinja2 joining a record's fields, instead of ``text_field``. ``datasets``: inputs read through
    ``datasets.load_dataset``, after the files.
    """
    check_output(os.path.abspath(output), overwrite)  # before any tokenizing work
    text = RecordText(text_field, template)
    tokenizer = load_tokenizer(tokenizer, eos) if isinstance(tokenizer, str) else tokenizer
    files = expand_inputs(inputs, split, text_suffixes)
    if chat is not None:
        for source in files:
            if source.kind == "text":
                raise DataError(f"--chat reads conversations from records (JSON, Parquet, Arrow, datasets), and "
                                f"'{source.path}' is plain text; pass files of {{\"messages\": [...]}} records.")
    records = None if chat is None else RECORD_COLUMNS[kind or "chat"]
    check_tables(files, text, records)
    total = sum(os.path.getsize(s.path) for s in files)
    writer = StoreWriter(output, tokenizer.vocab_size, shard_tokens, dtype, overwrite)
    if workers is None:  # byte tokens cost nothing and tokenizers' Rust batch encoder already uses every core
        workers = 1 if tokenizer.kind in ("byte", "huggingface") else os.cpu_count() or 1
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing")
    try:
        units = _units(files, datasets, text, records)
        if workers == 1:
            _init_worker(tokenizer, chat, text, kind)
            for unit in prefetched(units):
                _write(writer, _tokenize_unit(unit), unit[4], bar)
        else:
            start = (tokenizer, chat, text, kind)
            with multiprocessing.get_context("spawn").Pool(workers, _init_worker, start) as pool:
                pending: collections.deque = collections.deque()
                for unit in units:  # keep at most 2 units per worker in flight: memory stays flat
                    pending.append((pool.apply_async(_tokenize_unit, (unit,)), unit[4]))
                    while len(pending) >= 2 * workers:
                        result, size = pending.popleft()
                        _write(writer, result.get(), size, bar)
                while pending:
                    result, size = pending.popleft()
                    _write(writer, result.get(), size, bar)
        sources = [{"path": s.path, "bytes": os.path.getsize(s.path)} for s in files]
        sources += [spec.describe() for spec in datasets]
        extra = {"chat_template": chat.describe()} if chat is not None else {}
        extra.update({kind: True} if kind else {})
        return writer.finish(tokenizer.describe(), sources, tokenizer.eos_id, **extra)
    except BaseException:
        writer.abort()
        raise
    finally:
        if bar:
            bar.close()


def _write(writer: StoreWriter, docs: list, size: int, bar) -> None:
    for doc in docs:
        writer.add(*doc)
    if bar:
        bar.update(size)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxtron prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--input", action="append", default=[],
                        help="file, glob or directory (repeatable; ** recurses): text, JSON lines (also .gz, .bz2, "
                             ".xz, .zst), Parquet, Arrow, or a datasets.save_to_disk directory")
    parser.add_argument("--dataset", action="append", default=[],
                        help="a local dataset directory or builder (json, parquet, csv, ...) read through "
                             "datasets.load_dataset, after the --input files (repeatable)")
    parser.add_argument("--data-files", action="append", default=[], help="with --dataset: its data files")
    parser.add_argument("--subset", help="with --dataset: the configuration name")
    parser.add_argument("--split", help="the split of a DatasetDict directory or of --dataset (default: train, or "
                                        "a DatasetDict's only split)")
    parser.add_argument("--tokenizer", required=True,
                        help="'byte', a tokenizer.json, a SentencePiece .model, or a Hugging Face model directory")
    parser.add_argument("--output", required=True, help="directory of the token store")
    parser.add_argument("--text-field", default="text",
                        help="the field holding the text, dotted for nested fields (default: text)")
    parser.add_argument("--template", help="jinja2 joining a record's fields into its text, instead of --text-field")
    parser.add_argument("--text-suffix", action="append", default=[],
                        help="also read files with this suffix as plain text (repeatable; .txt always is)")
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
    parser.add_argument("--chat", action="store_true", help="conversations ('messages'), rendered with the chat "
                                                            "template, loss on the assistant's tokens only")
    parser.add_argument("--pairs", action="store_true", help="chosen/rejected pairs for DPO ('prompt', 'chosen', "
                                                             "'rejected'), rendered like --chat")
    parser.add_argument("--prompts", action="store_true", help="prompts for RL ('prompt' and any other fields, "
                                                               "kept for the reward function)")
    parser.add_argument("--chat-template", help="with --chat, --pairs or --prompts: a .jinja file or "
                                                "tokenizer_config.json to "
                                                "use instead of the tokenizer's own template")
    return parser


def main(argv: Sequence[str]) -> int:
    """`jaxtron prepare`: writes the token store the command line ``argv`` describes."""
    from jaxtron.common.console import console_logging

    console_logging()
    args = _parser().parse_args(argv)
    if not args.input and not args.dataset:
        raise DataError("jaxtron prepare needs --input or --dataset; name the data to tokenize.")
    if (args.data_files or args.subset) and not args.dataset:
        raise DataError("--data-files and --subset go with --dataset; add --dataset or leave them out.")
    kinds = [kind for kind in ("chat", "pairs", "prompts") if getattr(args, kind)]
    if len(kinds) > 1:
        raise DataError(f"--{kinds[0]} and --{kinds[1]} are two kinds of store; pass one of them.")
    if args.chat_template and not kinds:
        raise DataError("--chat-template is used only with --chat, --pairs or --prompts; add one or leave it out.")
    if args.template and kinds:
        raise DataError(f"--template and --{kinds[0]} both say how a record becomes text; pass one of them.")
    chat = load_template(args.tokenizer, args.chat_template) if kinds else None
    if args.workers is not None and args.workers < 1:
        raise DataError("--workers must be at least 1; pass a positive count.")
    suffixes = (*TEXT_SUFFIXES, *(s if s.startswith(".") else f".{s}" for s in args.text_suffix))
    datasets = [DatasetInput(path, tuple(args.data_files), args.subset, args.split or "train")
                for path in args.dataset]
    args.output = user_path(args.output)
    manifest = prepare(args.input, args.tokenizer, args.output, args.text_field, args.workers,
                       progress=sys.stderr.isatty(), shard_tokens=args.shard_tokens, dtype=args.dtype,
                       eos=args.eos, overwrite=args.overwrite, chat=chat, template=args.template, split=args.split,
                       text_suffixes=suffixes, datasets=datasets, kind="" if args.chat else "".join(kinds))
    log.info("wrote %s: %d documents, %d tokens (%s, vocabulary %d, end-of-document id %s) in %d shard(s)",
             args.output, manifest["num_documents"], manifest["num_tokens"], manifest["dtype"],
             manifest["vocab_size"], manifest["eos_id"], len(manifest["shards"]))
    return 0
