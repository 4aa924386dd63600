"""Where the periods of the layer stack are stored for a pipeline schedule, and moving between two such orders.

The rules table cuts the stacked ``layers`` axis over the ``pipeline`` mesh axis in contiguous blocks, one per
stage. With virtual stages a stage runs periods that are not contiguous in the model's order (period
(r * S + s) * P + p runs on stage s in round r), so the stack is kept stage-major: ``storage_order`` says which
period each stored position holds. Checkpoints record that order (``layer_order`` in their config), and a
restore under another schedule moves the periods into the current one (``reorder``); parameters read for
export or fine-tuning are put back into the model's natural order the same way.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.parallel.sharding import logical_names


def storage_order(periods: int, stages: int = 1, virtual_stages: int = 1) -> np.ndarray:
    """The natural period index stored at each position of the stage-major stack: ``stacked[i]`` holds period
    ``storage_order(...)[i]``. The identity when ``virtual_stages`` is 1."""
    per = periods // (stages * virtual_stages)
    s, r, p = np.meshgrid(np.arange(stages), np.arange(virtual_stages), np.arange(per), indexing="ij")
    return ((r * stages + s) * per + p).reshape(-1)


def _stacked(leaf: Any) -> bool:
    """Whether a leaf is a stacked layer parameter or one of its optimizer moments (an nnx Variable whose first
    axis is ``layers``)."""
    return isinstance(leaf, nnx.Variable) and logical_names(leaf)[:1] == ("layers",)


def reorder(tree: Any, saved: Sequence[int] | None, wanted: Sequence[int] | None) -> Any:
    """``tree`` (parameters or a train state of nnx Variables) with every stacked leaf moved from the period
    order ``saved`` into ``wanted`` (None: the natural order). Each leaf keeps its sharding; one leaf at a time
    is copied."""
    if saved is None and wanted is None:
        return tree
    periods = len(saved if saved is not None else wanted)
    saved = np.arange(periods) if saved is None else np.asarray(saved)
    wanted = np.arange(periods) if wanted is None else np.asarray(wanted)
    if np.array_equal(saved, wanted):
        return tree
    # wanted position i holds period wanted[i], which sits at position where[wanted[i]] of the saved stack
    where = np.argsort(saved)
    take = where[wanted]

    def move(leaf):
        if not _stacked(leaf):
            return leaf
        value = leaf.get_value()
        group = value.shape[0] // periods  # blocks per period in this stack (dense blocks of an MoE period)

        def permute(a):
            grouped = a.reshape(periods, group, *a.shape[1:])
            return jnp.take(grouped, jnp.asarray(take), axis=0).reshape(a.shape)

        if isinstance(value, jax.core.Tracer):  # inside a jitted initialiser
            return leaf.replace(permute(value))
        return leaf.replace(jax.jit(permute, out_shardings=value.sharding, donate_argnums=0)(value))

    return jax.tree.map(move, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def to_natural(array: np.ndarray, saved: Sequence[int]) -> np.ndarray:
    """A stacked host array (first axis: blocks) stored in the period order ``saved``, in the natural order."""
    periods = len(saved)
    grouped = array.reshape(periods, array.shape[0] // periods, *array.shape[1:])
    return grouped[np.argsort(np.asarray(saved))].reshape(array.shape)
