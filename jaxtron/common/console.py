"""The console log every command prints."""

from __future__ import annotations

import logging


def console_logging() -> None:
    """The log format every command prints in, at INFO, without what its libraries say at INFO: jax's "Unable to
    initialize backend 'tpu'" is not news, and orbax logs every file operation."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    for name in ("jax._src.xla_bridge", "absl"):
        logging.getLogger(name).setLevel(logging.WARNING)
