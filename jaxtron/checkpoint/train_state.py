"""Orbax checkpoints of the train state, the data iterator's state and the resolved config.

Saves are asynchronous (training goes on while the arrays are written) and atomic (orbax writes
into a temporary directory and renames it when complete, so a save cut off midway is never seen as
a checkpoint). Restoring places every array directly into the current run's shardings, so a
checkpoint written on one mesh restores onto another.

Integrity: after each save is committed, every process records checksums of the files it wrote
(``jaxtron.checkpoint.integrity``), in a background thread for asynchronous saves. Before a restore the files are
verified; the run resumes from the newest intact checkpoint, and newer damaged ones are moved to
``<workdir>/checkpoints_damaged/``. ``jaxtron verify WORKDIR`` checks a run's checkpoints.

Old checkpoints beyond ``keep`` are dropped whole: orbax renames each into ``checkpoints/.dropped/`` (one atomic
step), and its files are deleted from there. Deleted in place, a kill midway would leave a checkpoint with some of
its files gone, which a resumed run and ``verify`` would take for damage.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxtron.checkpoint import integrity, layouts
from jaxtron.config.loader import migrate
from jaxtron.config.schema import Config, ConfigError, ModelConfig
from jaxtron.parallel.stages import reorder, resized

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LAYER_ORDER = "layer_order"  # saved config key: the period order of the stored layer stack (natural if absent)
STORAGE_KEYS = (LAYER_ORDER, layouts.LAYOUT_KEY)  # saved config keys that say how the state is stored
RESTORE_BUFFER_GB = 4
DROPPED_DIR = ".dropped"  # inside CHECKPOINT_DIR: checkpoints past `keep`, renamed here whole, then deleted


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; one sentence naming what differs, exit 2."""


def abstract_with_shardings(abstract_state: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying the target shardings (the shardings tree is a prefix of the state's)."""
    def one(sharding, subtree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), subtree)
    return jax.tree.map(one, shardings, abstract_state, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))


def _state_types() -> ocp.type_handlers.TypeHandlerRegistry:
    """orbax's handlers for what a train state holds, with one choice made explicit: each shard is written by
    the process that holds its first replica (orbax's GPU behaviour). orbax otherwise splits replicated shards
    across their replicas unless JAX_PLATFORMS names a GPU, so a GPU run took one path or the other by an
    environment variable. The split costs an on-device slice per replica and leaf, each its own compiled
    program (4 of a small run's 12 s on 8 CPU devices, at its first save). It would shorten saves when the
    data axis spans hosts; without it, the hosts of the first data replica write the whole checkpoint."""
    scalars = ocp.type_handlers.ScalarHandler()
    return ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)),
        (np.ndarray, ocp.type_handlers.NumpyHandler()),
        (int, scalars), (float, scalars), (np.number, scalars))


class Checkpointer:
    def __init__(self, workdir: str, keep: int, keep_every: int = 0, async_save: bool = True,
                 compress: bool = False, checksums: bool = True):
        self.directory = os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)
        self.async_save, self.checksums = async_save, checksums
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=1, max_to_keep=keep, keep_period=keep_every or None,
            enable_async_checkpointing=async_save, create=True, todelete_subdir=DROPPED_DIR)
        # zstd (orbax's default) shrinks fp32 weights and moments by about 10% but halves save and restore speed
        # (benchmarks/README.md), so arrays are written uncompressed. Restores read at most RESTORE_BUFFER_GB at
        # a time: unbounded, the host holds a second copy of the whole state while restoring.
        handlers = {"state": ocp.PyTreeCheckpointHandler(use_zarr3=True, use_compression=compress,
                                                          restore_concurrent_gb=RESTORE_BUFFER_GB,
                                                          type_handler_registry=_state_types()),
                    "data": ocp.JsonCheckpointHandler(), "config": ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._recording: threading.Thread | None = None
        self._recording_error: BaseException | None = None
        self.last_watch_hash_s = 0.0  # seconds the last save's files were hashed while it ran (benchmarks)

    def remove_incomplete(self) -> None:
        """Deletes the saves cut off midway (a process died while writing them: orbax never loads them), which
        would otherwise hold their disk space for good. The training run calls it once it is accepted."""
        for name in integrity.incomplete_saves(self.directory):
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
            log.warning("removed %s, a save cut off while being written (never loaded)", name)
        self._delete_dropped()

    def _delete_dropped(self) -> None:
        """Deletes the checkpoints orbax dropped (renamed into DROPPED_DIR whole), with no save in flight; a kill
        midway leaves the rest there, for the next call. Only process 0 deletes, as only it drops."""
        dropped = os.path.join(self.directory, DROPPED_DIR)
        if jax.process_index() == 0 and os.path.isdir(dropped):
            shutil.rmtree(dropped, ignore_errors=True)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def save(self, step: int, state: Any, data_state: dict, config: dict) -> None:
        """Saves now (the loop decides when); returns once the arrays are copied off the devices, and the
        files are written and their checksums recorded in the background when asynchronous."""
        self._finish_recording()  # the previous save's checksums are complete before this save starts
        self.manager.wait_until_finished()  # (orbax's save waits for it too)
        self._delete_dropped()
        config = {**config, layouts.LAYOUT_KEY: layouts.PARAM_LAYOUT}
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_state),
                                  config=ocp.args.JsonSave(config))
        watcher = integrity.Watcher(self.directory, step, jax.process_index()).start() if self.checksums else None
        try:
            self.manager.save(step, args=args, force=True)
        except BaseException:
            if watcher is not None:
                watcher.stop()
            raise
        if watcher is None:
            return
        if self.async_save:
            self._recording = threading.Thread(target=self._record_in_background, args=(step, watcher),
                                               name=f"checksums-step-{step}")
            self._recording.start()
        else:
            self._record(step, watcher)

    def _record(self, step: int, watcher: integrity.Watcher) -> None:
        # Only committed files are recorded: waiting here also keeps orbax from removing old steps meanwhile,
        # since its garbage collection runs inside the next save, which waits for this thread first.
        try:
            self.manager.wait_until_finished()
        finally:
            known = watcher.stop()
        self.last_watch_hash_s = watcher.hash_s
        integrity.record(self.step_dir(step), jax.process_index(), jax.process_count(), known=known)
        self._delete_dropped()  # those this save's commit dropped

    def _record_in_background(self, step: int, watcher: integrity.Watcher) -> None:
        try:
            self._record(step, watcher)
        except BaseException as e:  # noqa: BLE001 (re-raised in the loop's thread by _finish_recording)
            self._recording_error = e

    def _finish_recording(self) -> None:
        if self._recording is not None:
            self._recording.join()
            self._recording = None
        if self._recording_error is not None:
            error, self._recording_error = self._recording_error, None
            raise error

    def restore(self, step: int, abstract_state: Any, shardings: Any, cfg: Config,
                verify: bool = True, layer_order: Sequence[int] | None = None) -> tuple[Any, dict]:
        """The state (in ``shardings``, its layer stack in ``layer_order``, default natural) and data-iterator
        state saved at ``step``, its files verified first."""
        reason = integrity.check_everywhere(self.step_dir(step)) if verify else None
        if reason is None:
            restored, reason = self._restore_verified(step, abstract_state, shardings, cfg, None, layer_order)
            if reason is None:
                return restored
        raise CheckpointError(f"checkpoint '{self.step_dir(step)}' is damaged ({reason}); check the run with "
                              f"`jaxtron verify {os.path.dirname(self.directory)}`.")

    def restore_latest(self, abstract_state: Any, shardings: Any, cfg: Config,
                       check_data: Callable[[dict], None] | None = None,
                       layer_order: Sequence[int] | None = None) -> tuple[Any, dict] | None:
        """The newest intact checkpoint's state (its layer stack in ``layer_order``, default natural) and
        data-iterator state, None if there is no checkpoint.
        Newer damaged ones are named, one line each, and moved to ``<workdir>/checkpoints_damaged/`` (so that
        their step numbers can be saved again); if none is intact, nothing is moved and CheckpointError says so.
        ``check_data`` sees the data-iterator state before any array is read, and may refuse it by raising."""
        steps = list(self.manager.all_steps())
        step, restored, damaged = integrity.newest_intact(
            self.directory, steps,
            lambda s: self._restore_verified(s, abstract_state, shardings, cfg, check_data, layer_order))
        if step is None:
            if not steps:
                return None
            if damaged == [(steps[-1], integrity.NO_MANIFEST)]:
                # the one save was cut before its checksums: as if never made (kept aside), the run starts anew
                self._move_aside([steps[-1]])
                return None
            raise CheckpointError(integrity.none_intact(self.directory, damaged, " and start again in a new --workdir"))
        self._move_aside([s for s, _ in damaged])
        return restored

    def _restore_verified(self, step: int, abstract_state: Any, shardings: Any, cfg: Config,
                          check_data: Callable[[dict], None] | None = None,
                          layer_order: Sequence[int] | None = None) -> tuple[tuple[Any, dict] | None, str | None]:
        """Restores a verified step; an orbax failure all the same is damage (agreed by all processes)."""
        # orbax reports unreadable data as ValueError, or as a bare Exception wrapping tensorstore's error
        failure = restored = None
        try:
            saved = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore(),
                                                                       data=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 - named in the damage line, never dropped
            failure = e
        if failure is None:
            # another model or data setup: the user's mistake, not damage; refused before any array is read
            _check_compatible(saved["config"], cfg, self.step_dir(step))
            if check_data is not None:
                check_data(saved["data"])
            wanted = abstract_with_shardings(abstract_state, shardings)
            target = resized(wanted, saved["config"].get(LAYER_ORDER), layer_order)  # its identity periods
            layout = layouts.saved_layout(saved["config"])
            stored = layouts.in_layout(target, layout)
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(stored,
                                                 restore_args=ocp.checkpoint_utils.construct_restore_args(stored))))
                restored = {"state": layouts.from_layout(restored["state"], target, layout), "data": saved["data"]}
            except Exception as e:  # noqa: BLE001 - named in the damage line, never dropped
                failure = e
        if failure is None:  # stored for another pipeline schedule: the periods move into this run's order
            restored["state"] = reorder(restored["state"], saved["config"].get(LAYER_ORDER), layer_order, wanted)
        reason = integrity.agree(failure and f"verified but cannot be restored ({type(failure).__name__}: "
                                             f"{str(failure).splitlines()[0][:200] if str(failure) else ''})")
        return (None, reason) if reason else ((restored["state"], restored["data"]), None)

    def _move_aside(self, steps: list[int]) -> None:
        if not steps:
            return
        if jax.process_index() == 0:
            for step in steps:
                log.warning("moved damaged checkpoint %d to %s", step, integrity.move_aside(self.step_dir(step)))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("jaxtron damaged checkpoints moved aside")
        self.manager.reload()  # the manager's list of steps was read before the move

    def wait(self) -> None:
        """Blocks until the save in flight is written and its checksums recorded."""
        self.manager.wait_until_finished()
        self._finish_recording()
        self._delete_dropped()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()


def _check_compatible(saved: dict, cfg: Config, where: str) -> None:
    """A checkpoint of another architecture (any field of ``ModelConfig.architecture_fields``) is refused with
    the differing fields named; how the model runs (``execution``) may change between runs."""
    current = cfg.to_dict()["model"]
    saved_model = migrate(saved).get("model", {})  # a checkpoint of an older layout names fields as it did
    defaults = dataclasses.asdict(ModelConfig())  # fields added after a checkpoint was written have their default

    def value(tree: dict, path: str, default: Any = None) -> Any:
        for name in path.split("."):
            if not isinstance(tree, dict) or name not in tree:
                return default
            tree = tree[name]
        return tree

    differ = []
    for path in ModelConfig.architecture_fields():
        old, new = value(saved_model, path, value(defaults, path)), value(current, path)
        if old != new:
            differ.append(f"model.{path} {old!r} != {new!r}")
    if differ:
        raise CheckpointError(f"checkpoint '{where}' is of another model architecture ({'; '.join(differ)}); "
                              "use the config it was written with or a new --workdir.")
    optimizer = value(saved, "optimizer.name", "adamw")  # checkpoints from before Muon hold AdamW's state
    if optimizer != cfg.optimizer.name:
        raise CheckpointError(f"checkpoint '{where}' holds the state of another optimizer (optimizer.name "
                              f"{optimizer!r} != {cfg.optimizer.name!r}), whose moments this run's cannot take; "
                              f"resume with --config.optimizer.name={optimizer} or start a new --workdir.")
