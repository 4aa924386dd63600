"""``jaxtron.train``: a training run from Python, as ``jaxtron train`` runs it from the command line.

    import jaxtron
    metrics = jaxtron.train("default", workdir="runs/a", overrides=["--config.train.steps=100"],
                            hooks=[jaxtron.Hook(every=10, run=lambda step, metrics: print(step, metrics["loss"]))])
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from jaxtron.training.hooks import Hook


def train(config: Any, workdir: str, overrides: Sequence[str] = (), hooks: Sequence[Hook] = ()) -> dict[str, Any]:
    """Trains ``config`` into ``workdir`` and returns the final metrics (``RunSummary.metrics``).

    ``config``: a config file's path (``FILE[:ARG]``), a shipped config's name, an ``ml_collections.ConfigDict`` or
    a ``Config``. ``overrides``: ``--config.<section>.<field>=VALUE`` strings, as on the command line. ``hooks``:
    ``Hook`` values run after the built-in work of a step, in order. A preempted run (a signal, Ctrl-C) returns
    after its checkpoint with ``metrics["preempted"]`` saying why. Bad input raises ``ConfigError``."""
    import jax

    from jaxtron.common.files import user_path
    from jaxtron.config.loader import config_of
    from jaxtron.config.schema import replace
    from jaxtron.inference.downstream import task_hook
    from jaxtron.parallel import launch
    from jaxtron.planning.remat import resolve_for_devices
    from jaxtron.training.loop import Trainer

    cfg = config_of(config, overrides)
    workdir = user_path(workdir)  # '~', relative, a trailing slash: one directory, wherever the run is read from
    if cfg.train.init_from:  # saved absolute, so that a LoRA run's base is found from any directory
        cfg = replace(cfg, train=replace(cfg.train, init_from=user_path(cfg.train.init_from)))
    launch.initialize(cfg.distributed)  # before anything asks jax about devices
    if jax.process_index() != 0:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        trainer = Trainer(cfg, workdir, [*task_hook(cfg), *hooks], resolve_remat=resolve_for_devices)
        return trainer.run().metrics()
    finally:
        launch.finish()  # all processes leave together
