"""Where a benchmark script leaves its results: ``benchmarks/NAME.json`` (the rows) beside ``benchmarks/NAME.md`` (the
table a reader opens), each written whole."""

from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def write(name: str, rows, table: str) -> str:
    """Writes ``rows`` as JSON and ``table`` as markdown under ``benchmarks/NAME``; -> the markdown file's path."""
    from jaxtron.common.files import write_atomic

    out = os.path.join(HERE, name)
    write_atomic(out + ".json", json.dumps(rows, indent=1))
    write_atomic(out + ".md", table)
    return out + ".md"
