"""Every call into jax's private coordination client (``jax._src.distributed.global_state.client``): jax has no
public handle on the client that ``jax.distributed.initialize`` starts, and a multi-process run needs three things of
it: a key-value store (each process's node name, ``mesh.node_names``), the live peers and a barrier (the peer
monitor, ``launch.PeerMonitor``). ``tests/test_launch.py`` checks the names and signatures used here against the
installed jax, so that an upgrade that moves them fails a test rather than a multi-node run."""

from __future__ import annotations

from typing import Any

# what the peer monitor and the node names call on the client
CLIENT_METHODS = ("key_value_set", "blocking_key_value_get", "get_live_nodes", "wait_at_barrier")


def client_type() -> type:
    """The class of the client jax starts (for the signature test)."""
    from jax._src.lib import _jax

    return _jax.DistributedRuntimeClient


def client() -> Any:
    """The coordination client of this process (after ``jax.distributed.initialize``), None before it."""
    from jax._src import distributed

    return distributed.global_state.client


def share(key: str, value: str) -> None:
    """Publishes ``value`` under ``key`` to every process of the run."""
    client().key_value_set(key, value)


def wait_for(key: str, timeout_ms: int) -> str:
    """The value some process published under ``key``, waiting up to ``timeout_ms`` for it."""
    return client().blocking_key_value_get(key, timeout_ms)
