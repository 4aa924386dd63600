"""The one mapping from today's parameter paths to those of older layouts, so that every older checkpoint and
converted model loads.

- Layout 1 (before ``models/projection.py``): a projection's weight sat directly under its module
  (``layers.attn.wq``), its adapters beside it (``layers.attn.wq_lora_a``, ``wq_lora_b``), and one dropout seed
  served all of a module's adapted projections (``layers.attn.lora_seed``).
- Layout 2 (``PARAM_LAYOUT``): each projection is a module of its own: ``layers.attn.wq.weight``, ``.lora_a``,
  ``.lora_b`` and ``.lora_seed`` (the module's seed, copied to each of its projections).

A train-state checkpoint names its layout in its saved config (``LAYOUT_KEY``; absent: 1). A converted model's
manifest lists its parameters by path, so the names it holds say which layout it has (``stored_name``).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

PARAM_LAYOUT = 2
LAYOUT_KEY = "param_layout"  # saved config key: the parameter layout of the checkpoint (absent: 1)


def older(path: Sequence[str]) -> tuple[str, ...]:
    """Where layout 1 kept what layout 2 keeps at ``path`` (a parameter's path, or any path that ends in one)."""
    *parent, leaf = path
    if not parent:
        return tuple(path)
    if leaf == "weight":
        return tuple(parent)
    if leaf in ("lora_a", "lora_b"):
        return (*parent[:-1], f"{parent[-1]}_{leaf}")
    if leaf == "lora_seed":
        return (*parent[:-1], leaf)
    return tuple(path)


def stored_name(dotted: str, names: Container[str]) -> str | None:
    """The name under which a store that holds ``names`` keeps the parameter at the dotted path ``dotted``: that
    path (layout 2), or its layout-1 form; None when it holds neither."""
    if dotted in names:
        return dotted
    old = ".".join(older(dotted.split(".")))
    return old if old in names else None


def saved_layout(config: dict) -> int:
    """The parameter layout of a checkpoint, from its saved config."""
    return int(config.get(LAYOUT_KEY, 1))


def _older_state(state: Any) -> Any:
    """A parameter State (or one shaped like the parameters: a moment) with its paths in layout 1."""
    from flax import nnx

    return nnx.from_flat_state({older(tuple(map(str, path))): value for path, value in nnx.to_flat_state(state)})


def _copy(x: Any) -> Any:
    import jax
    import jax.numpy as jnp

    return jax.jit(jnp.copy)(x) if isinstance(x, jax.Array) else x


def _is_state(node: Any) -> bool:
    from flax import nnx

    return isinstance(node, nnx.State)


def in_layout(tree: Any, layout: int) -> Any:
    """``tree`` (a train state, or its parameters, shaped as today's) with every parameter State in it (the
    parameters, the optimizer's moments) keyed as a checkpoint of ``layout`` stores it: the restore target for such
    a checkpoint. Several of today's leaves may read one stored value."""
    import jax

    if layout == PARAM_LAYOUT:
        return tree
    return jax.tree.map(lambda node: _older_state(node) if _is_state(node) else node, tree, is_leaf=_is_state)


def from_layout(restored: Any, tree: Any, layout: int) -> Any:
    """``tree``'s structure filled from ``restored`` (what ``in_layout(tree, layout)`` restored to)."""
    import jax
    from flax import nnx

    if layout == PARAM_LAYOUT:
        return restored

    def fill(want: Any, got: Any) -> Any:
        if not _is_state(want):
            return got
        stored = {tuple(map(str, path)): value for path, value in nnx.to_flat_state(got)}
        taken, out = set(), {}
        for path, _ in nnx.to_flat_state(want):
            old = older(tuple(map(str, path)))
            # a second reader of one stored value gets a copy: the train step donates its state, and one buffer
            # donated twice crashes the process
            out[path] = jax.tree.map(_copy if old in taken else (lambda x: x), stored[old])
            taken.add(old)
        return nnx.from_flat_state(out)

    return jax.tree.map(fill, tree, restored, is_leaf=_is_state)
