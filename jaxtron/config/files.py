"""Config files: the shipped ones found by name from any directory, and a file's ``get_config(arg)`` run, every
failure one ConfigError sentence."""

from __future__ import annotations

import importlib.util
import os

import ml_collections

from jaxtron.config.checks import ConfigError

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shipped_configs() -> str | None:
    """The folder of the configs shipped with the package: ``jaxtron/configs/`` in an installed package (setup.py
    puts the repository's ``configs/`` there), else ``configs/`` beside the package in a checkout."""
    installed, checkout = os.path.join(_PACKAGE, "configs"), os.path.join(os.path.dirname(_PACKAGE), "configs")
    if os.path.isfile(os.path.join(installed, "default.py")):
        return installed
    if os.path.isfile(os.path.join(os.path.dirname(_PACKAGE), "setup.cfg")) and os.path.isdir(checkout):
        return checkout
    return None


def shipped_names() -> list[str]:
    """The names ``--config`` takes for the shipped configs (``llama3_8b`` for ``configs/llama3_8b.py``)."""
    folder = shipped_configs()
    names = os.listdir(folder) if folder else []
    return sorted(n[:-3] for n in names if n.endswith(".py") and not n.startswith("_"))


def config_file(path: str) -> str:
    """The file ``--config`` names: a path (``configs/llama3_8b.py``, ``~/my.py``) as given when it exists, else a
    shipped config's name (``llama3_8b``, with or without ``.py``), found from any directory."""
    given = os.path.expanduser(path)
    if os.path.isfile(given):
        return given
    name = os.path.basename(given).removesuffix(".py")
    folder = shipped_configs()
    if folder and os.path.dirname(given) in ("", "configs") and name in shipped_names():
        return os.path.join(folder, name + ".py")
    raise ConfigError(f"config file '{path}' does not exist; pass a file (--config=path/to/X.py) or a shipped "
                      f"config's name ({', '.join(shipped_names()) or 'none installed'}).")


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """Runs ``get_config(arg)`` of ``FILE[:ARG]`` (a path or a shipped config's name) and returns its
    ConfigDict."""
    path, _, arg = spec.partition(":")
    path = config_file(path)
    module_spec = importlib.util.spec_from_file_location("jaxtron_user_config", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - a user's file may raise anything; report it in one sentence
        raise ConfigError(f"config file '{path}' failed to load ({one_line(e)}); fix the file.") from None
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file '{path}' defines no get_config(); add one returning a ConfigDict.")
    try:
        config = module.get_config(arg) if arg else module.get_config()
    except Exception as e:  # noqa: BLE001 - as above: the user's get_config() may raise anything
        if isinstance(e, (TypeError, ValueError)) and arg:  # a signature or a value it does not take
            raise ConfigError(f"config file '{path}' get_config() rejected the argument {arg!r} ({one_line(e)}); "
                              "check the ':ARG' part of --config.") from None
        raise ConfigError(f"config file '{path}' get_config() raised {one_line(e)}; fix the file.") from None
    if not isinstance(config, (ml_collections.ConfigDict, dict)):
        raise ConfigError(f"config file '{path}' get_config() returned {type(config).__name__}; return a ConfigDict.")
    return ml_collections.ConfigDict(config)


def one_line(e: Exception) -> str:
    """'Type: message' with the message's line breaks folded, so the error stays one sentence."""
    message = " ".join(str(e).split()).rstrip(".")  # a trailing period would end the sentence early
    return f"{type(e).__name__}: {message}" if message else type(e).__name__
