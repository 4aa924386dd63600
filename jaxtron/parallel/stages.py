"""Where the periods of the layer stack are stored for a pipeline schedule, and moving between two such orders.

The rules table cuts the stacked ``layers`` axis over the ``pipeline`` mesh axis in contiguous blocks, one per
stage. With virtual stages a stage runs periods that are not contiguous in the model's order (period
(r * S + s) * P + p runs on stage s in round r), so the stack is kept stage-major: ``storage_order`` says which
period each stored position holds. Checkpoints record that order (``layer_order`` in their config), and a
restore under another schedule moves the periods into the current one (``reorder``); parameters read for
export or fine-tuning are put back into the model's natural order the same way.

With ``pipeline.uneven_stages`` the periods need not split evenly: the stack is filled up to the next multiple of
stages x virtual stages with identity periods (``PAD`` in an order), spread over the last stages, in the last
slots of each (``identity_slots``). They are zeros, the schedule skips their effect on the hidden state, so they
never receive a gradient; they cost a period's memory and compute each. A restore into a schedule with another
number of them drops or adds them; export and fine-tuning never see them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.parallel.sharding import logical_names

PAD = -1  # an identity period's entry in a storage order


def padding(periods: int, stages: int = 1, virtual_stages: int = 1) -> int:
    """Identity periods that fill ``periods`` up to a multiple of ``stages * virtual_stages``."""
    return -periods % (stages * virtual_stages)


def identity_slots(periods: int, stages: int = 1, virtual_stages: int = 1) -> np.ndarray:
    """Which slots of the padded stage-major stack hold identity periods: bool [stages, virtual stages, periods
    per round]. They are spread over the last stages, one more on a stage than on any earlier one at most, each
    stage's in its last slots."""
    pads = padding(periods, stages, virtual_stages)
    per = (periods + pads) // (stages * virtual_stages)
    on_stage = pads // stages + (np.arange(stages) >= stages - pads % stages)  # identity periods of each stage
    slot = np.arange(virtual_stages * per).reshape(1, virtual_stages, per)  # a slot's place in its stage's block
    return slot >= virtual_stages * per - on_stage[:, None, None]


def storage_order(periods: int, stages: int = 1, virtual_stages: int = 1) -> np.ndarray:
    """The natural period index stored at each position of the stage-major stack: ``stacked[i]`` holds period
    ``storage_order(...)[i]``, or ``PAD`` for the identity periods that fill an uneven split (``identity_slots``).
    The identity when ``virtual_stages`` is 1 and the periods split evenly."""
    identity = identity_slots(periods, stages, virtual_stages)
    s, r, p = np.meshgrid(*map(np.arange, identity.shape), indexing="ij")
    ran = ((r * stages + s) * identity.shape[2] + p).reshape(-1)  # when each stored slot runs in a pass
    real = ~identity.reshape(-1)
    # the model's periods run in the padded stack's order, skipping the identity ones
    order = np.full(ran.size, PAD, np.int64)
    order[real] = np.argsort(np.argsort(ran[real]))
    return order


def _positions(saved: Sequence[int] | None, wanted: Sequence[int] | None) -> tuple[int, np.ndarray]:
    """(stored positions of ``saved``, the saved position that holds each wanted position's period, or that
    count for an identity period) for two orders (None: natural)."""
    given = saved if saved is not None else wanted
    periods = int(np.sum(np.asarray(given) != PAD))
    saved = np.arange(periods) if saved is None else np.asarray(saved)
    wanted = np.arange(periods) if wanted is None else np.asarray(wanted)
    where = np.full(periods + 1, len(saved))  # period PAD (index -1) reads the appended zero period
    real = saved != PAD
    where[saved[real]] = np.nonzero(real)[0]
    return len(saved), where[wanted]


def _stacked(leaf: Any) -> bool:
    """Whether a leaf is a stacked layer parameter or one of its optimizer moments (an nnx Variable whose first
    axis is ``layers``)."""
    return isinstance(leaf, nnx.Variable) and logical_names(leaf)[:1] == ("layers",)


def _take(a: Any, stored: int, take: np.ndarray) -> Any:
    """The stacked array ``a`` of ``stored`` periods (each one or more blocks) rearranged by ``take``: position i
    holds stored period ``take[i]``, zeros where that is ``stored`` (an identity period)."""
    per_period = a.shape[0] // stored  # blocks per period in this stack (dense blocks of an MoE period)
    by_period = a.reshape(stored, per_period, *a.shape[1:])
    if (take == stored).any():
        by_period = jnp.concatenate([by_period, jnp.zeros((1, *by_period.shape[1:]), by_period.dtype)])
    return jnp.take(by_period, jnp.asarray(take), axis=0).reshape(len(take) * per_period, *a.shape[1:])


def reorder(tree: Any, saved: Sequence[int] | None, wanted: Sequence[int] | None, like: Any = None) -> Any:
    """``tree`` (parameters or a train state of nnx Variables) with every stacked leaf moved from the period
    order ``saved`` into ``wanted`` (None: the natural order), identity periods dropped or added as zeros. Each
    leaf keeps its sharding, or takes that of its counterpart in ``like`` (a tree of the same structure whose
    leaves carry shardings: needed when the number of identity periods changes); one leaf at a time is copied."""
    if saved is None and wanted is None:
        return tree
    stored, take = _positions(saved, wanted)
    if np.array_equal(take, np.arange(stored)):
        return tree
    is_var = lambda x: isinstance(x, nnx.Variable)

    def move(leaf, target=None):
        if not _stacked(leaf):
            return leaf
        value = leaf.get_value()
        if isinstance(value, jax.core.Tracer):  # inside a jitted initialiser
            return leaf.replace(_take(value, stored, take))
        sharding = value.sharding if target is None else target.get_value().sharding
        return leaf.replace(jax.jit(lambda a: _take(a, stored, take), out_shardings=sharding,
                                    donate_argnums=0)(value))

    if like is None:
        return jax.tree.map(move, tree, is_leaf=is_var)
    return jax.tree.map(move, tree, like, is_leaf=is_var)


def stored_rows(rows: int, saved: Sequence[int] | None, wanted: Sequence[int] | None = None) -> int:
    """Rows (blocks) of a stacked parameter stored in the order ``saved`` that has ``rows`` in the order ``wanted``
    (None: natural): they differ by the identity periods of either."""
    stored, take = _positions(saved, wanted)
    return rows // len(take) * stored


def resized(tree: Any, saved: Sequence[int] | None, wanted: Sequence[int] | None) -> Any:
    """An abstract tree (nnx Variables of sharded ShapeDtypeStructs) stored in the order ``wanted``, as it was
    stored in the order ``saved``: its stacked leaves hold the saved number of periods (identity ones included).
    Where that number does not split over the mesh axes of the stack's first dimension, the dimension is not
    sharded (the restore then moves it into place)."""
    stored, take = _positions(saved, wanted)
    if stored == len(take):
        return tree

    def resize(leaf):
        if not _stacked(leaf):
            return leaf
        value = leaf.get_value()
        shape = (stored_rows(value.shape[0], saved, wanted), *value.shape[1:])
        sharding = value.sharding
        pieces = value.shape[0] // sharding.shard_shape(value.shape)[0]
        if shape[0] % pieces:
            sharding = sharding.update(spec=jax.sharding.PartitionSpec(None, *sharding.spec[1:]))
        return leaf.replace(jax.ShapeDtypeStruct(shape, value.dtype, sharding=sharding))

    return jax.tree.map(resize, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def to_natural(array: np.ndarray, saved: Sequence[int]) -> np.ndarray:
    """A stacked host array (first axis: blocks) stored in the period order ``saved``, in the natural order
    (identity periods dropped)."""
    stored, take = _positions(saved, None)
    per_period = array.shape[0] // stored
    by_period = array.reshape(stored, per_period, *array.shape[1:])
    return by_period[take].reshape(len(take) * per_period, *array.shape[1:])
