"""The files `jaxtron prepare` reads, found and classified by name before any is opened.

An input is a file, a glob or a directory. A directory is walked for files of the kinds below; a directory that
``datasets.Dataset.save_to_disk`` wrote is read as its Arrow files, and one of a ``DatasetDict`` as its
``--split``. Files are taken in sorted path order, then records in their order within each file.

Kinds, by suffix:
- plain text (``.txt``, and the suffixes of ``--text-suffix``): one document per file;
- JSON (``.jsonl``, ``.ndjson``, ``.json``): one record per line, or a ``.json`` file holding one array;
- Parquet (``.parquet``), read by row group with only the needed columns;
- Arrow (``.arrow``), the IPC file or stream format, batch by batch.
Text and JSON may be compressed: ``.gz``, ``.bz2``, ``.xz``, ``.zst``. Named inputs of another kind are refused; a
directory's other files (a dataset card, ``.gitattributes``) are skipped and counted in the log.
"""

from __future__ import annotations

import bz2
import dataclasses
import glob
import gzip
import io
import json
import logging
import lzma
import os
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence

from jaxtron.data.errors import DataError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt",)
JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
TABLE_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".zstd")
# What datasets.save_to_disk writes beside the data, and a Hub dataset's metadata: never documents.
DATASET_METADATA = frozenset({"state.json", "dataset_info.json", "dataset_dict.json", "dataset_infos.json"})


@dataclasses.dataclass(frozen=True)
class Source:
    """One input file: its path, kind (text, json, parquet or arrow) and compression suffix (or None)."""

    path: str
    kind: str
    compression: str | None = None


def suffixes(name: str) -> tuple[str, str | None]:
    """(kind suffix, compression suffix or None) of a file name, lower-cased."""
    stem, last = os.path.splitext(name.lower())
    if last in COMPRESSIONS:
        return os.path.splitext(stem)[1], last
    return last, None


def classify(path: str, text_suffixes: Sequence[str] = TEXT_SUFFIXES) -> Source | None:
    """The path's Source, None for a kind jaxtron does not read, or DataError for an unreadable compression."""
    kind_suffix, compression = suffixes(os.path.basename(path))
    if kind_suffix in TABLE_SUFFIXES:
        if compression:
            raise DataError(f"'{path}' is a compressed {kind_suffix} file; {kind_suffix} files compress their own "
                            f"columns, so decompress it first.")
        return Source(path, TABLE_SUFFIXES[kind_suffix])
    if kind_suffix in JSON_SUFFIXES:
        return Source(path, "json", compression)
    if kind_suffix in tuple(s.lower() for s in text_suffixes):
        return Source(path, "text", compression)
    last = os.path.splitext(path.lower())[1]
    stem_suffix = os.path.splitext(os.path.splitext(path.lower())[0])[1]
    if stem_suffix in (*JSON_SUFFIXES, *text_suffixes, *TABLE_SUFFIXES) and last:
        raise DataError(f"'{path}' has compression '{last}', which jaxtron does not read; use one of "
                        f"{', '.join(COMPRESSIONS)}, or decompress it.")
    return None


def _refuse_kind(path: str, text_suffixes: Sequence[str]) -> DataError:
    known = [*text_suffixes, *JSON_SUFFIXES, *TABLE_SUFFIXES]
    return DataError(f"'{path}' has an extension jaxtron does not read; inputs are {', '.join(known)} (text and JSON "
                     f"also compressed), directories of them, or save_to_disk directories; pass --text-suffix "
                     f"{os.path.splitext(path)[1] or 'SUFFIX'} to read it as plain text.")


def expand_inputs(patterns: Sequence[str], split: str | None = None,
                  text_suffixes: Sequence[str] = TEXT_SUFFIXES) -> list[Source]:
    """Every input file of ``patterns`` (files, globs, directories), classified, in sorted path order."""
    found: dict[str, Source] = {}
    for pattern in patterns:
        pattern = os.path.expanduser(pattern)
        if os.path.isfile(pattern) or os.path.isdir(pattern):  # a plain path, even one with glob characters in it
            matched = [pattern]
        else:
            matched = sorted(glob.glob(pattern, recursive=True))
        sources = []
        for path in matched:
            if os.path.isdir(path):
                sources += _directory(path, split, text_suffixes)
            elif os.path.isfile(path):
                source = classify(path, text_suffixes)
                if source is None:
                    raise _refuse_kind(path, text_suffixes)
                sources.append(source)
        if not sources:
            raise DataError(f"--input '{pattern}' matches no files jaxtron reads; check the path or quote the glob.")
        found.update((s.path, s) for s in sources)
    return [found[p] for p in sorted(found)]


def _directory(path: str, split: str | None, text_suffixes: Sequence[str]) -> list[Source]:
    """The input files of a directory: a save_to_disk dataset's Arrow files, or the readable files below it."""
    dataset_dict = os.path.join(path, "dataset_dict.json")
    if os.path.isfile(dataset_dict):
        splits = _read_json(dataset_dict).get("splits") or []
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in splits:
            raise DataError(f"'{path}' is a DatasetDict with splits {', '.join(map(str, splits))}; pick one with "
                            "--split.")
        return _directory(os.path.join(path, split), None, text_suffixes)
    state = os.path.join(path, "state.json")
    if os.path.isfile(state):
        files = _read_json(state).get("_data_files")
        if not isinstance(files, list) or not all(isinstance(f, dict) and "filename" in f for f in files):
            raise DataError(f"'{state}' lists no data files; the save_to_disk directory is incomplete.")
        return [Source(os.path.join(path, f["filename"]), "arrow") for f in files]
    sources, skipped = [], []
    for directory, subdirs, names in os.walk(path):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        if directory != path and {"state.json", "dataset_dict.json"} & set(names):
            subdirs[:] = []  # a dataset saved below: its own files say what to read
            sources += _directory(directory, split, text_suffixes)
            continue
        for name in sorted(names):
            file = os.path.join(directory, name)
            source = None if name.startswith(".") or name in DATASET_METADATA else classify(file, text_suffixes)
            (sources if source else skipped).append(source or file)
    if skipped:
        log.info("skipped %d file(s) of other kinds in %s: %s", len(skipped), path,
                 ", ".join(os.path.relpath(f, path) for f in skipped[:5]) + (" ..." if len(skipped) > 5 else ""))
    return sources


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"'{path}' is not readable JSON ({e}); the dataset directory is damaged.") from None
    if not isinstance(value, dict):
        raise DataError(f"'{path}' does not hold a JSON object; the dataset directory is damaged.")
    return value


def _zstd_open(path: str):
    import zstandard
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))


OPENERS = {None: lambda p: open(p, "rb"), ".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open,  # noqa: SIM115
           ".zst": _zstd_open, ".zstd": _zstd_open}


def decompression_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a corrupt or truncated compressed stream raises."""
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, lzma.LZMAError)
    try:
        import zstandard
        errors += (zstandard.ZstdError,)
    except ImportError:
        pass
    return errors


def open_binary(source: Source):
    """The file's bytes, decompressed."""
    if source.compression in (".zst", ".zstd"):
        try:
            import zstandard  # noqa: F401
        except ImportError:
            raise DataError(f"'{source.path}' is zstd-compressed and the zstandard package is missing; install it "
                            "(pip install zstandard).") from None
    return OPENERS[source.compression](source.path)


def read_bytes(source: Source) -> bytes:
    """A whole text file, decompressed; DataError naming the file if its compression is damaged."""
    try:
        with open_binary(source) as f:
            return f.read()
    except decompression_errors() as e:
        raise DataError(f"'{source.path}' is not valid {source.compression or 'file'} data or is cut short ({e}); "
                        "replace the file.") from None


def read_lines(source: Source) -> Iterable[bytes]:
    """The file's lines, decompressed; DataError naming the file if its compression is damaged."""
    try:
        with open_binary(source) as f:
            yield from f
    except decompression_errors() as e:
        raise DataError(f"'{source.path}' is not valid {source.compression or 'file'} data or is cut short ({e}); "
                        "replace the file.") from None


def prefetched(units: Iterator, depth: int = 4) -> Iterator:
    """``units`` (a prepare's work) read ahead by a thread: reading and decompressing overlap the tokenizer."""
    done = object()
    ready: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def read():
        try:
            for unit in units:
                while not stop.is_set():
                    try:
                        ready.put(unit, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            ready.put(done)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            ready.put(e)

    thread = threading.Thread(target=read, name="prepare-reader", daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()
