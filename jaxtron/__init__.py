"""jaxtron: JAX/XLA SPMD training of large language models.

``jaxtron.train(config, workdir, overrides=(), hooks=())`` runs training from Python (``jaxtron/api.py``);
``jaxtron.Hook(every=N, run=fn)`` calls ``fn(step, metrics)`` after every N-th step. Both are imported on first
use, so that ``import jaxtron`` (and ``jaxtron --help``) starts without jax.
"""

__version__ = "0.1.0"
__all__ = ["Hook", "train"]


def __getattr__(name: str):
    if name == "train":
        from jaxtron.api import train
        return train
    if name == "Hook":
        from jaxtron.training.hooks import Hook
        return Hook
    raise AttributeError(f"module 'jaxtron' has no attribute {name!r}")
