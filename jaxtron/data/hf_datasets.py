"""Local data through ``datasets.load_dataset``, streamed, with the network off.

``--dataset PATH`` takes what ``load_dataset`` takes: a local dataset directory (a copy of a Hub dataset, with
its card's configs) or a packaged builder (``csv``, ``json``, ``parquet``, ``text``, ...) with ``--data-files``.
Streaming reads the files lazily, so memory stays flat. ``HF_HUB_OFFLINE`` and ``HF_DATASETS_OFFLINE`` are set
before ``datasets`` is imported: a name that would need the Hub is refused, not downloaded.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence

from jaxtron.data.errors import DataError

ROWS = 1024


@dataclasses.dataclass(frozen=True)
class DatasetInput:
    """One ``load_dataset`` call: its path or builder, data files, configuration name and split."""

    path: str
    data_files: tuple[str, ...] = ()
    subset: str | None = None
    split: str = "train"

    def describe(self) -> dict:
        return {"dataset": self.path, "data_files": list(self.data_files), "subset": self.subset,
                "split": self.split}


def _load(spec: DatasetInput):
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        import datasets
    except ImportError:
        raise DataError("--dataset needs the datasets package; install it (pip install 'jaxtron[data]').") from None
    files = [os.path.expanduser(f) for f in spec.data_files] or None
    try:
        loaded = datasets.load_dataset(os.path.expanduser(spec.path), spec.subset, data_files=files,
                                       split=spec.split, streaming=True)
    except Exception as e:  # noqa: BLE001 - datasets raises many types (FileNotFoundError, ValueError, its own)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"datasets.load_dataset('{spec.path}') cannot read local data ({first}); pass a local "
                        "dataset directory, or a builder such as json or parquet with --data-files.") from None
    if not isinstance(loaded, datasets.IterableDataset):
        raise DataError(f"datasets.load_dataset('{spec.path}') gave no single split; pick one with --split.")
    return loaded


def dataset_batches(spec: DatasetInput, columns: Sequence[str], every: bool = False) -> Iterator[dict[str, list]]:
    """Batches of the dataset's rows as {column: values} (of ``columns``, or with ``every`` of all of them);
    DataError if a needed column is missing."""
    loaded = _load(spec)
    try:
        for batch in loaded.iter(batch_size=ROWS):
            missing = [c for c in columns if c not in batch]
            if missing:
                raise DataError(f"dataset '{spec.path}' has no column '{missing[0]}'; its columns are: "
                                f"{', '.join(sorted(batch)) or 'none'}.")
            yield dict(batch) if every else {c: batch[c] for c in columns}
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged file surfaces as the reading library's own error type
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"dataset '{spec.path}' failed while being read ({first}); check its files.") from None
