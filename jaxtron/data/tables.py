"""Parquet and Arrow files read in batches of rows, with only the columns a document needs.

Parquet is read row group by row group and Arrow files batch by batch, with plain reads, so memory stays
flat whatever a file's size. Opening a file reads its schema, so a corrupt file or a missing column is refused, with the
file's columns listed, before any document is tokenized.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from jaxtron.data.errors import DataError
from jaxtron.data.sources import Source

ROWS = 1024  # rows per batch: a few MB of web text, enough for the tokenizer's threads to share


def _damaged(source: Source, error: Exception) -> DataError:
    what = "Parquet" if source.kind == "parquet" else "Arrow"
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return DataError(f"'{source.path}' is not a readable {what} file ({first}); replace or remove it.")


def _arrow_reader(path: str):
    """An Arrow IPC file reader, or a stream reader (what save_to_disk writes). Plain reads, not a memory map:
    mapped pages once read would count in the resident set, which then grows with the file."""
    import pyarrow as pa
    try:
        return pa.ipc.open_file(pa.OSFile(path))
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(pa.OSFile(path))


def schema(source: Source):
    """The file's schema; DataError if it is not a readable file of its kind."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        if source.kind == "parquet":
            return pq.ParquetFile(source.path).schema_arrow
        return _arrow_reader(source.path).schema
    except (pa.ArrowException, OSError) as e:
        raise _damaged(source, e) from None


def check_columns(source: Source, table_schema, path: Sequence[str], what: str) -> None:
    """Refuses a file without the (nested) column ``path``, naming the columns it has."""
    import pyarrow as pa
    fields = list(table_schema)
    for depth, key in enumerate(path):
        names = [f.name for f in fields]
        if key not in names:
            inner = f" inside '{'.'.join(path[:depth])}'" if depth else ""
            raise DataError(f"'{source.path}' has no column '{key}'{inner} for {what}; its columns{inner} are: "
                            f"{', '.join(names) or 'none'}.")
        kind = fields[names.index(key)].type
        if depth + 1 < len(path):
            if not pa.types.is_struct(kind):
                raise DataError(f"'{source.path}' column '{'.'.join(path[:depth + 1])}' is {kind}, not a struct, so "
                                f"'{'.'.join(path)}' cannot be read; pass the right --text-field.")
            fields = [kind.field(i) for i in range(kind.num_fields)]


def check_text_type(source: Source, table_schema, column: str) -> None:
    """Refuses a flat text column that does not hold strings."""
    import pyarrow as pa
    kind = table_schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)
            or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
        raise DataError(f"'{source.path}' column '{column}' holds {kind}, not text; pass a --text-field that holds "
                        "strings, or a --template.")


def batches(source: Source, columns: Sequence[str] | None) -> Iterator[tuple[object, int]]:
    """(record batch of ``columns`` (None: all), approximate file bytes it came from), in row order."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    size = os.path.getsize(source.path)
    try:
        if source.kind == "parquet":
            # one row group at a time: pyarrow's iter_batches kept every batch it had read allocated (0.57 GiB
            # after a 0.6 GB file), while a row group read alone is freed once its batches are done (8 MiB)
            file = pq.ParquetFile(source.path, page_checksum_verification=True)
            rows = max(file.metadata.num_rows, 1)
            for group in range(file.num_row_groups):
                for batch in file.read_row_group(group, columns=None if columns is None else list(columns),
                                                   use_threads=False).to_batches(ROWS):
                    yield batch, size * batch.num_rows // rows
            return
        reader = _arrow_reader(source.path)
        parts = (reader.get_batch(i) for i in range(reader.num_record_batches)) \
            if isinstance(reader, pa.ipc.RecordBatchFileReader) else reader
        for part in parts:
            part = part if columns is None else part.select(list(columns))
            for start in range(0, part.num_rows, ROWS):
                piece = part.slice(start, ROWS)
                yield piece, min(piece.nbytes, size)
    except (pa.ArrowException, OSError) as e:
        raise _damaged(source, e) from None
