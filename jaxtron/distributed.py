"""Joining a multi-process run.

A process joins when the coordinator is given explicitly through the environment:
JAX_COORDINATOR_ADDRESS (host:port), JAX_NUM_PROCESSES and JAX_PROCESS_ID. Otherwise the run is a
single process. This must happen before anything asks jax about devices.
"""

from __future__ import annotations

import logging
import os

import jax

from jaxtron.config import ConfigError

log = logging.getLogger(__name__)

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _int_env(name: str) -> int:
    text = os.environ.get(name, "")
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"environment variable {name} is {text!r}, not an integer; set it to one.") from None


def initialize() -> bool:
    """Joins the run described by the environment; returns whether this is a multi-process run."""
    given = [name for name in ENV if os.environ.get(name)]
    if not given:
        return False
    if len(given) != len(ENV):
        missing = ", ".join(name for name in ENV if name not in given)
        raise ConfigError(f"{', '.join(given)} set but {missing} not; set all of {', '.join(ENV)} or none.")
    count, index = _int_env("JAX_NUM_PROCESSES"), _int_env("JAX_PROCESS_ID")
    if count < 1 or not 0 <= index < count:
        raise ConfigError(f"JAX_PROCESS_ID {index} is not in [0, JAX_NUM_PROCESSES={count}); fix the environment.")
    # CPU collectives across processes need gloo; the setting does not affect GPU backends
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], num_processes=count, process_id=index)
    log.info("process %d of %d joined the run at %s", index, count, os.environ["JAX_COORDINATOR_ADDRESS"])
    return True
