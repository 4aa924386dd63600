"""Orbax checkpoints of the train state, the data iterator's state and the resolved config.

Saves are asynchronous (training goes on while the arrays are written) and atomic (orbax writes
into a temporary directory and renames it when complete, so a save cut off midway is never seen as
a checkpoint). Restoring places every array directly into the current run's shardings, so a
checkpoint written on one mesh restores onto another.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxtron.config import Config, ConfigError, ModelConfig

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
RESTORE_BUFFER_GB = 4


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; one sentence naming what differs, exit 2."""


def abstract_with_shardings(abstract_state: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying the target shardings (the shardings tree is a prefix of the state's)."""
    def one(sharding, subtree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), subtree)
    return jax.tree.map(one, shardings, abstract_state, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))


class Checkpointer:
    def __init__(self, workdir: str, keep: int, keep_every: int = 0, async_save: bool = True,
                 compress: bool = False):
        self.directory = os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=1, max_to_keep=keep, keep_period=keep_every or None,
            enable_async_checkpointing=async_save, create=True)
        # zstd (orbax's default) shrinks fp32 weights and moments by about 10% but halves save and restore speed
        # (benchmarks/README.md), so arrays are written uncompressed. Restores read at most RESTORE_BUFFER_GB at
        # a time: unbounded, the host holds a second copy of the whole state while restoring.
        handlers = {"state": ocp.PyTreeCheckpointHandler(use_zarr3=True, use_compression=compress,
                                                          restore_concurrent_gb=RESTORE_BUFFER_GB),
                    "data": ocp.JsonCheckpointHandler(), "config": ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        incomplete = sorted(n for n in os.listdir(self.directory) if "tmp" in n) if os.path.isdir(self.directory) else []
        if incomplete:  # a save cut off midway (the process died while writing): never loaded
            log.warning("ignoring incomplete checkpoint(s) %s, cut off while being written; the latest complete "
                        "one is step %s", ", ".join(incomplete), self.manager.latest_step())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, data_state: dict, config: dict) -> None:
        """Saves now (the loop decides when); returns once the arrays are copied off the devices, and the
        files are written in the background when asynchronous."""
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_state),
                                  config=ocp.args.JsonSave(config))
        self.manager.save(step, args=args, force=True)

    def restore(self, step: int, abstract_state: Any, shardings: Any, cfg: Config) -> tuple[Any, dict]:
        """The state (in ``shardings``) and data-iterator state saved at ``step``."""
        saved = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        _check_compatible(saved, cfg, os.path.join(self.directory, str(step)))
        target = abstract_with_shardings(abstract_state, shardings)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)),
                data=ocp.args.JsonRestore()))
        except (ValueError, KeyError, OSError) as e:
            raise CheckpointError(f"checkpoint '{self.directory}/{step}' cannot be restored "
                                  f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                                  "remove it to fall back to an earlier one or use a new --workdir.") from None
        return restored["state"], restored["data"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _check_compatible(saved: dict, cfg: Config, where: str) -> None:
    """A checkpoint of another model shape is refused with the differing fields named."""
    current = cfg.to_dict()["model"]
    shape_fields = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                    "activation", "norm", "position_embedding", "max_seq_len", "tie_embeddings", "num_experts",
                    "moe_every")
    defaults = dataclasses.asdict(ModelConfig())  # fields added after a checkpoint was written have their default
    model = {**{k: defaults[k] for k in ("num_experts", "moe_every")}, **saved.get("model", {})}
    differ = [f"model.{k} {model.get(k)!r} != {current[k]!r}" for k in shape_fields if model.get(k) != current[k]]
    if differ:
        raise CheckpointError(f"checkpoint '{where}' is of another model shape ({'; '.join(differ)}); "
                              "use the config it was written with or a new --workdir.")

