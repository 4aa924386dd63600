"""Parameters alone on disk: converted models, and the parameters inside a training run's checkpoint.

A converted model keeps ``params/manifest.json`` and one orbax item per slice of each parameter. The
slices are the HF tensors: a layer of a stacked parameter, or one expert of one layer. Writing one slice
at a time bounds host memory by the largest tensor, because orbax copies what it writes. Restoring
stacks the slices into the target sharding. A training run's checkpoint
(``checkpoints/<step>/state``) is read for its ``params`` subtree alone; the optimizer state is not read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxtron.checkpoint import integrity, layouts
from jaxtron.checkpoint.train_state import (
    CHECKPOINT_DIR,
    LAYER_ORDER,
    RESTORE_BUFFER_GB,
    CheckpointError,
    abstract_with_shardings,
)
from jaxtron.parallel.sharding import without_leading_axes
from jaxtron.parallel.stages import reorder, resized

PARAMS_DIR = "params"
MANIFEST = "manifest.json"


def _checkpointer() -> ocp.Checkpointer:
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True, use_compression=False,
                                                        restore_concurrent_gb=RESTORE_BUFFER_GB))


def _item(root: str, path: str, index: tuple[int, ...]) -> str:
    return os.path.join(root, path + "".join(f".{i}" for i in index))


def save_params(directory: str, flat: Mapping[str, np.ndarray], split: Mapping[str, int]) -> None:
    """Writes ``flat`` ({dotted path: array}) to ``directory/params``; ``split[path]`` leading dimensions of a
    parameter are cut into separate items. The manifest is written last: without it nothing is read."""
    root = os.path.join(os.path.abspath(directory), PARAMS_DIR)
    manifest = {}
    with _checkpointer() as checkpointer:
        for path, value in flat.items():
            k = split.get(path, 0)
            manifest[path] = {"shape": list(value.shape), "dtype": str(value.dtype), "split": k}
            for index in np.ndindex(*value.shape[:k]):
                checkpointer.save(_item(root, path, index), args=ocp.args.PyTreeSave({"value": value[index]}))
    with open(os.path.join(root, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)


def _manifest(root: str) -> dict:
    try:
        with open(os.path.join(root, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError):
        raise CheckpointError(f"'{root}' has no readable {MANIFEST}; the conversion did not finish, so convert "
                              "again into a new directory.") from None


def _restore(checkpointer, item: str, target: Any) -> Any:
    one = {"value": target}
    return checkpointer.restore(item, args=ocp.args.PyTreeRestore(
        one, restore_args=ocp.checkpoint_utils.construct_restore_args(one)))["value"]


def read_slice(root: str, path: str, index: tuple[int, ...], manifest: dict | None = None) -> np.ndarray:
    """One slice of a converted parameter as a host array (``index`` covers at least its split dimensions)."""
    meta = (manifest or _manifest(root))[path]
    k = meta["split"]
    with _checkpointer() as checkpointer:
        restored = checkpointer.restore(_item(root, path, index[:k]), args=ocp.args.PyTreeRestore(
            restore_args={"value": ocp.RestoreArgs(restore_type=np.ndarray)}))["value"]
    return np.asarray(restored)[index[k:]]


def _restore_converted(root: str, target: Any) -> Any:
    with _checkpointer() as checkpointer:
        return _restore_converted_with(checkpointer, root, target)


def _restore_converted_with(checkpointer: ocp.Checkpointer, root: str, target: Any) -> Any:
    from flax import nnx
    manifest, values = _manifest(root), {}
    for path, var in nnx.to_flat_state(target):
        name = ".".join(map(str, path))
        stored = layouts.stored_name(name, manifest)  # a model converted before projections were modules: older
        want = var.get_value()
        meta = manifest.get(stored)
        if meta is None or tuple(meta["shape"]) != want.shape:
            found = "absent" if meta is None else f"of shape {tuple(meta['shape'])}"
            raise CheckpointError(f"parameter '{name}' is {found} in '{root}' but this model needs shape "
                                  f"{want.shape}; use the config the parameters were converted with.")
        k = meta["split"]
        if k == 0:
            values[name] = _restore(checkpointer, _item(root, stored, ()), want)
            continue
        part = jax.ShapeDtypeStruct(want.shape[k:], want.dtype,
                                    sharding=without_leading_axes(want.sharding, len(want.shape), k))
        slices = [_restore(checkpointer, _item(root, stored, index), part) for index in np.ndindex(*want.shape[:k])]
        values[name] = jax.jit(lambda *xs, shape=want.shape: jnp.stack(xs).reshape(shape),
                               out_shardings=want.sharding)(*slices)
        del slices
    restored = jax.tree.map(lambda x: x, target)  # a new State: the caller's abstract one stays as it was
    nnx.replace_by_pure_dict(restored, nest(values))
    return restored


def nest(flat: Mapping[str, Any]) -> dict:
    """{"a.b.c": x} -> {"a": {"b": {"c": x}}} (the pure-dict form of an nnx State)."""
    nested: dict = {}
    for path, value in flat.items():
        node = nested
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return nested


def latest_run_state(path: str) -> str | None:
    """The newest intact checkpoint of the training run in ``path``, its files verified (None if there is
    none). Newer damaged ones are named and left where they are: the run is another's, read only."""
    runs = os.path.join(path, CHECKPOINT_DIR)
    step, _, damaged = integrity.newest_intact(runs, integrity.steps_in(runs))  # damaged ones stay in place
    if step is None and damaged:
        raise CheckpointError(integrity.none_intact(runs, damaged))
    return None if step is None else os.path.join(runs, str(step))


def saved_config(step_dir: str) -> dict:
    """The config a run's checkpoint was saved with (its layer order and parameter layout among its keys)."""
    with open(os.path.join(step_dir, "config", "metadata")) as f:
        return json.load(f)


def saved_layer_order(step_dir: str) -> list[int] | None:
    """The period order of the layer stack in a run's checkpoint (None: natural)."""
    return saved_config(step_dir).get(LAYER_ORDER)


def restore_params(path: str, abstract_params: Any, shardings: Any, step_dir: str | None = None,
                   layer_order: Sequence[int] | None = None) -> Any:
    """Parameters from a converted model (``path/params``) or from the newest intact checkpoint of a training run
    (``path/checkpoints``; ``step_dir`` when the caller already found and verified it), placed into ``shardings``,
    the layer stack in the period order ``layer_order`` (None: natural)."""
    path = os.path.abspath(os.path.expanduser(path))
    wanted = abstract_with_shardings(abstract_params, shardings)
    try:
        if os.path.isdir(os.path.join(path, PARAMS_DIR)):  # converted models are in the natural order
            params = _restore_converted(os.path.join(path, PARAMS_DIR), resized(wanted, None, layer_order))
            return reorder(params, None, layer_order, wanted)
        step_dir = step_dir or latest_run_state(path)
        if step_dir is None:
            raise CheckpointError(f"'{path}' holds neither {PARAMS_DIR}/ (a converted model) nor a checkpoint of a "
                                  f"training run ({CHECKPOINT_DIR}/<step>); point it at one of those.")
        config = saved_config(step_dir)
        saved, layout = config.get(LAYER_ORDER), layouts.saved_layout(config)
        target = resized(wanted, saved, layer_order)  # as many identity periods as the run stored
        stored = layouts.in_layout(target, layout)
        restore_args = ocp.checkpoint_utils.construct_restore_args(stored)
        with _checkpointer() as checkpointer:
            restored = checkpointer.restore(os.path.join(step_dir, "state"), args=ocp.args.PyTreeRestore(
                {"params": stored}, restore_args={"params": restore_args}, partial_restore=True))["params"]
        return reorder(layouts.from_layout(restored, target, layout), saved, layer_order, wanted)
    except CheckpointError:
        raise
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise CheckpointError(f"parameters in '{path}' do not match this model ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]}); use the config they were written with.") from None
