"""Loads an ml_collections config file and applies ``--config.<path>=<value>`` overrides.

The syntax is the one of ml_collections' config_flags (``--config=FILE[:ARG]``), parsed here so that
every mistake becomes one ConfigError sentence instead of a flags traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import typing
from typing import Any, Mapping, Sequence

import ml_collections

from jaxtron.config.schema import SECTIONS, Config, ConfigError


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """Runs ``get_config(arg)`` of ``FILE[:ARG]`` and returns its ConfigDict."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' does not exist; pass --config=configs/<name>.py.")
    module_spec = importlib.util.spec_from_file_location("jaxtron_user_config", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # a user's file may raise anything; report it in one sentence
        raise ConfigError(f"config file '{path}' failed to load ({_one_line(e)}); fix the file.") from None
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file '{path}' defines no get_config(); add one returning a ConfigDict.")
    try:
        config = module.get_config(arg) if arg else module.get_config()
    except Exception as e:  # as above: the user's get_config() may raise anything
        if isinstance(e, TypeError) and arg:
            raise ConfigError(f"config file '{path}' get_config() rejected the argument {arg!r} ({_one_line(e)}); "
                              "check the ':ARG' part of --config.") from None
        raise ConfigError(f"config file '{path}' get_config() raised {_one_line(e)}; fix the file.") from None
    if not isinstance(config, (ml_collections.ConfigDict, dict)):
        raise ConfigError(f"config file '{path}' get_config() returned {type(config).__name__}; return a ConfigDict.")
    return ml_collections.ConfigDict(config)


def _one_line(e: Exception) -> str:
    """'Type: message' with the message's line breaks folded, so the error stays one sentence."""
    message = " ".join(str(e).split()).rstrip(".")  # a trailing period would end the sentence early
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


def apply_overrides(config: ml_collections.ConfigDict, overrides: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Applies (dotted path, string value) pairs; returns the resulting nested dict."""
    values = config.to_dict()
    for path, text in overrides:
        kind = field_type(path)  # raises for unknown sections and fields
        section, name = path.split(".", 1)
        value = parse_value(path, kind, text)
        if not isinstance(values.setdefault(section, {}), dict):
            raise ConfigError(f"config section '{section}' must be a group of fields, not {values[section]!r}; "
                              "make it a dict of fields in the config file.")
        values[section][name] = value
    return values


def split_overrides(argv: Sequence[str]) -> tuple[str | None, list[tuple[str, str]], list[str]]:
    """Separates ``--config=``, ``--config.x.y=v`` and the remaining arguments."""
    config_spec, overrides, rest = None, [], []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--config.") or arg.startswith("--config="):
            key, eq, value = arg[2:].partition("=")
            if not eq:  # "--config.x.y v" form
                if i + 1 >= len(args):
                    raise ConfigError(f"option '--{key}' has no value; write --{key}=VALUE.")
                value = args[i + 1]
                i += 1
            if key == "config":
                config_spec = value
            else:
                overrides.append((key[len("config."):], value))
        elif arg == "--config":
            if i + 1 >= len(args):
                raise ConfigError("option '--config' has no value; write --config=configs/<name>.py.")
            config_spec = args[i + 1]
            i += 1
        else:
            rest.append(arg)
        i += 1
    return config_spec, overrides, rest


def load_config(spec: str, overrides: Sequence[tuple[str, str]] = ()) -> Config:
    """Config file + overrides -> validated, frozen Config."""
    return from_mapping(apply_overrides(load_config_file(spec), overrides))


def _field_types(cls) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def parse_value(field: str, kind: type, text: str) -> Any:
    """Parses a command-line override string into the field's type."""
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ConfigError(f"config field '{field}' expects bool but got {text!r}; "
                          f"pass true or false to --config.{field}.")
    try:
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        return text
    except ValueError:
        raise ConfigError(f"config field '{field}' expects {kind.__name__} but got {text!r}; "
                          f"pass a valid {kind.__name__} to --config.{field}.") from None


def field_type(path: str) -> type:
    """The type of a dotted field path such as 'train.steps'; ConfigError if it does not exist."""
    section, _, name = path.partition(".")
    if section not in SECTIONS:
        raise ConfigError(f"config section '{section}' does not exist; use one of {', '.join(SECTIONS)}.")
    types = _field_types(SECTIONS[section])
    if not name:
        raise ConfigError(f"config section '{section}' cannot be set as a whole; set one of its fields with "
                          f"--config.{section}.<field>=VALUE.")
    if name not in types:
        close = difflib.get_close_matches(name, types, n=1)
        guess = f"'{section}.{close[0]}' (closest match) or another field" if close else "one of the fields"
        raise ConfigError(f"config field '{path}' does not exist; use {guess} of '{section}': "
                          f"{', '.join(sorted(types))}.")
    return types[name]


def _coerce(path: str, kind: type, value: Any) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is bool and isinstance(value, bool) or kind is not bool and type(value) is kind:
        return value
    raise ConfigError(f"config field '{path}' must be {kind.__name__} but is {type(value).__name__} "
                      f"({value!r}); fix it in the config file or with --config.{path}.")


def from_mapping(values: Mapping[str, Any]) -> Config:
    """Builds and validates a Config from a nested mapping (e.g. ``ConfigDict.to_dict()``)."""
    sections = {}
    for section, content in values.items():
        if section not in SECTIONS:
            raise ConfigError(f"config section '{section}' does not exist; use one of {', '.join(SECTIONS)}.")
        if not isinstance(content, Mapping):
            raise ConfigError(f"config section '{section}' must be a group of fields, not {content!r}; "
                              "make it a dict of fields in the config file.")
        kwargs = {}
        for name, value in content.items():
            path = f"{section}.{name}"
            kwargs[name] = _coerce(path, field_type(path), value)
        sections[section] = SECTIONS[section](**kwargs)
    return Config(**sections)
