"""RL's reward function: a user's Python function named by ``rl.reward``, loaded once and called on every
completion. A function that cannot be loaded, that raises, or that returns anything but a finite number is one
sentence (``ConfigError``), never a traceback or a silently wrong reward."""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import os
import sys
from collections.abc import Callable
from typing import Any

from jaxtron.config.checks import ConfigError

Reward = Callable[[str, str, dict], float]  # (the prompt, the completion, the prompt's record) -> its reward


def load_reward(spec: str) -> Reward:
    """``module:function`` (importable from the working directory or the path) or ``path/file.py:function``."""
    module, _, name = spec.rpartition(":")
    fix = "name a function f(prompt, completion, record) -> float as module:function or path/file.py:function"
    try:
        if module.endswith(".py"):
            path = os.path.abspath(os.path.expanduser(module))
            loader = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
            if loader is None or not os.path.isfile(path):
                raise FileNotFoundError(f"no file {path}")
            loaded = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(loaded)
        else:
            if os.getcwd() not in sys.path:  # a module beside the run, as `python -m` would find it
                sys.path.append(os.getcwd())
            loaded = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure of the user's module is one sentence
        raise ConfigError(f"config field 'rl.reward' ('{spec}') cannot be imported ({type(e).__name__}: {e}); "
                          f"{fix}.") from None
    function = getattr(loaded, name, None)
    if not callable(function):
        raise ConfigError(f"config field 'rl.reward' ('{spec}'): module '{module}' has no function '{name}'; {fix}.")
    return function


def score(reward: Reward, spec: str, prompt: str, completion: str, record: dict[str, Any]) -> float:
    """``reward``'s value for one completion, checked to be a finite number."""
    try:
        value = reward(prompt, completion, record)
    except Exception as e:  # noqa: BLE001 - the user's function failing is one sentence, naming the input
        raise ConfigError(f"the reward function rl.reward ('{spec}') raised {type(e).__name__}: {e} on the "
                          f"completion {completion[:60]!r}; fix the function.") from None
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ConfigError(f"the reward function rl.reward ('{spec}') returned {value!r} for the completion "
                          f"{completion[:60]!r}, not a finite number; return a float.")
    return float(value)
