"""Command lines and config files -> a validated Config.

``--config=FILE[:ARG]`` and ``--config.<section>.<field>=VALUE`` are parsed by ml_collections' ``config_flags``
on absl flags, over the config file laid on the schema's defaults (a file only sets what differs, any field can be
overridden); what it would report as a flags traceback is checked here first, so that every mistake is one
ConfigError sentence.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
import textwrap
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections
from absl import flags
from ml_collections import config_flags

from jaxtron.config.files import config_file, load_config_file, one_line, shipped_configs, shipped_names
from jaxtron.config.model import FLAT_MODEL_FIELDS, older_family
from jaxtron.config.schema import SECTIONS, Config, ConfigError, replace

__all__ = ["config_file", "shipped_configs", "shipped_names"]  # found here too, as before config/files.py

log = logging.getLogger(__name__)


def parse_command_line(argv: Sequence[str], default_spec: str | None = None,
                       define: Callable[[flags.FlagValues], None] | None = None,
                       ) -> tuple[Config, flags.FlagValues, str]:
    """Parses ``argv`` (program name first) with absl flags: the ``--config.<section>.<field>=VALUE`` overrides
    through ml_collections' ``config_flags``, plus the flags ``define`` adds. Returns the validated Config, the
    parsed flags and the config file's ``FILE[:ARG]`` (``--config``, else ``default_spec``).

    The file's ``get_config()`` is laid over ``defaults()``, so a file only sets what differs and any field can
    be overridden. What config_flags would report as a traceback (a missing file, a misspelt field) is checked
    first; every mistake is one ConfigError sentence."""
    spec, argv = _split_config_spec(list(argv))
    spec = spec or default_spec
    if any(a in ("--help", "-h", "--helpfull") for a in argv[1:]):
        raise HelpRequested(_help(define, default_spec))
    if spec is None:
        raise ConfigError("option '--config' is missing; pass --config=configs/<name>.py or a shipped config's "
                          "name (--config=default).")
    cfg, values = _parse_over(load_config_file(spec).to_dict(), argv, define)
    return cfg, values, spec


def _parse_over(given: Mapping[str, Any], argv: list[str], define) -> tuple[Config, flags.FlagValues]:
    """The Config of ``argv``'s overrides (program name first) laid over the config mapping ``given``."""
    paths = _override_paths(argv)
    for path in paths:
        field_type(path)  # raises for unknown sections and fields
    given = migrate(given, warn=True)
    named = "family" in (given.get("model") or {}) or "model.family" in paths
    merged = _over_defaults(given)
    for path in paths:  # each section on an override's way must be a section in the file too
        names = path.split(".")
        for i in range(1, len(names)):
            where = ".".join(names[:i])
            content = merged[where]
            if not isinstance(content, ml_collections.ConfigDict):
                raise _not_a_section(where, content)
    try:
        values = _flag_values(argv, merged, define)
        rest = values(argv)[1:]
    except flags.IllegalFlagValueError as e:
        raise ConfigError(_illegal_value(str(e))) from None
    except flags.UnrecognizedFlagError as e:
        raise ConfigError(f"option '--{e.flagname}' does not exist; see --help.") from None
    except flags.Error as e:  # a missing value
        missing = re.search(r"Missing value for flag (--\S+)", str(e))
        if missing:
            raise ConfigError(f"option '{missing[1]}' has no value; write {missing[1]}=VALUE.") from None
        raise ConfigError(f"{one_line(e)}; see --help.") from None
    if rest:
        raise ConfigError(f"argument '{rest[0]}' is not an option; write options as --name=VALUE.")
    return from_mapping(values.config.to_dict(), named), values


def config_of(config: str | ml_collections.ConfigDict | Config, overrides: Sequence[str] = ()) -> Config:
    """The validated Config of a config file's path (``FILE[:ARG]``), a shipped config's name, a ``ConfigDict`` or
    a ``Config``, with ``overrides`` in the command line's forms (``--config.train.steps=4``) laid over it."""
    overrides = list(overrides)
    for option in overrides:
        if not isinstance(option, str) or not re.match(r"^--(no)?config\.", option):
            raise ConfigError(f"override {option!r} is not of the form --config.<section>.<field>=VALUE.")
    if isinstance(config, str):
        return parse_command_line(["jaxtron", *overrides], config)[0]
    if isinstance(config, (Config, ml_collections.ConfigDict)):
        return _parse_over(config.to_dict(), ["jaxtron", *overrides], None)[0]
    raise ConfigError(f"config {config!r} is neither a config file's path, a shipped config's name, a ConfigDict "
                      "nor a Config.")


class HelpRequested(Exception):
    """``--help`` was asked for: the message is the options' help text."""


def _help(define: Callable[[flags.FlagValues], None] | None, default_spec: str | None) -> str:
    """The help of a command's own flags (those ``define`` adds) and of ``--config``. The config's fields are named
    in one line, not listed: they are many, and jaxtron/config/schema.py documents each."""
    values = flags.FlagValues()
    if define is not None:
        define(values)
    if default_spec and os.path.isabs(default_spec) and default_spec.startswith(os.getcwd() + os.sep):
        default_spec = os.path.relpath(default_spec)  # as the user would write it from here
    default = f" (default: {default_spec})" if default_spec else ""
    overrides = ("overrides any field of the config, e.g. --config.train.steps=100 or, in a subsection of the "
                 "model, --config.model.rope.theta=1e6; the sections and fields are documented in "
                 "jaxtron/config/schema.py and jaxtron/config/model.py")
    rows = [("--config=FILE[:ARG]", f"a config file whose get_config([ARG]) returns a ConfigDict{default}"),
            ("--config.<section>.<field>=VALUE", overrides)]
    own = {flag.name: flag for module_flags in values.flags_by_module_dict().values() for flag in module_flags}
    for flag in sorted(own.values(), key=lambda flag: flag.name):
        name = f"--{flag.name}" if flag.boolean else f"--{flag.name}={flag.flag_type().upper()}"
        default = f" (default: {str(flag.default).lower() if flag.boolean else flag.default})" \
            if flag.default is not None else ""
        rows.append((name, flag.help + default))
    return "options:\n" + "\n".join(f"  {name}\n" + textwrap.fill(text, 100, initial_indent=" " * 6,
                                                                 subsequent_indent=" " * 6) for name, text in rows)


def defaults() -> ml_collections.ConfigDict:
    """Every section and field of the schema at its default value."""
    return ml_collections.ConfigDict(Config().to_dict())


def _over_defaults(values: Mapping[str, Any]) -> ml_collections.ConfigDict:
    """A config file's values laid over ``defaults()``, section by section (an int where the default is a float becomes
    a float, so that an override of that field parses as a float); what the schema does not know is kept for
    ``from_mapping`` to name."""
    def lay(out: dict, given: Mapping[str, Any]) -> None:
        for name, value in given.items():
            default = out.get(name)
            if isinstance(default, dict) and isinstance(value, Mapping):
                lay(default, value)
            else:
                widen = isinstance(default, float) and type(value) is int
                out[name] = float(value) if widen else value

    out = defaults().to_dict()
    lay(out, values)
    return ml_collections.ConfigDict(out)


def _flag_values(argv: list[str], config: ml_collections.ConfigDict, define) -> flags.FlagValues:
    values = flags.FlagValues()
    config_flags.DEFINE_config_dict("config", config, "the config; --config=FILE[:ARG] names a file with a "
                                    "get_config(), --config.<section>.<field>=VALUE overrides any field",
                                    flag_values=values, sys_argv=argv)
    if define is not None:
        define(values)
    return values


def _split_config_spec(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the value of --config, ``argv`` without it)."""
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg[len("--config="):], argv[:i] + argv[i + 1:]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("option '--config' has no value; write --config=configs/<name>.py or "
                                  "--config=<name>.")
            return argv[i + 1], argv[:i] + argv[i + 2:]
    return None, argv


def _override_paths(argv: list[str]) -> list[str]:
    """The field paths of the ``--config.<path>[=VALUE]`` options in ``argv``."""
    return [re.sub(r"^--(no)?config\.", "", a).split("=", 1)[0] for a in argv if re.match(r"^--(no)?config\.", a)]


def _illegal_value(message: str) -> str:
    """absl's 'flag --config.train.steps=abc: invalid literal ...' as one sentence naming the field."""
    match = re.match(r"flag --config\.([\w.]+)=(.*?): (.*)", " ".join(message.split()))
    if not match:
        return f"{' '.join(message.split()).rstrip('.')}; fix the value."
    path, value, reason = match.groups()
    kind = field_type(path).__name__
    if kind == "bool":
        return f"config field '{path}' expects bool but got {value!r}; pass true or false to --config.{path}."
    return (f"config field '{path}' expects {kind} but got {value!r} ({reason.rstrip('.')}); "
            f"pass a valid {kind} to --config.{path}.")


def load_config(spec: str, overrides: Sequence[tuple[str, str]] = ()) -> Config:
    """Config file + (dotted path, text) overrides -> validated, frozen Config (``parse_command_line``)."""
    return parse_command_line(["jaxtron", *(f"--config.{k}={v}" for k, v in overrides)], spec)[0]


def overrides(base: Config, other: Config) -> list[str]:
    """The ``--config.<section>.<field>=VALUE`` options that turn ``base`` into ``other`` (each field that differs,
    in the schema's order); ``parse_command_line`` of ``base``'s file with them gives ``other``."""
    def flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        out = {}
        for key, value in tree.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, Mapping) else {prefix + key: value})
        return out

    def text(value: Any) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, (tuple, list)):
            return ",".join(map(str, value))
        return str(value)

    mine, theirs = flat(base.to_dict()), flat(other.to_dict())
    return [f"--config.{path}={text(value)}" for path, value in theirs.items() if mine.get(path) != value]


def split_overrides(argv: Sequence[str]) -> tuple[str | None, list[tuple[str, str]], list[str]]:
    """Separates ``--config=``, ``--config.x.y=v`` and the remaining arguments, for tools that take several
    config files with the same overrides (``benchmarks/``); ``load_config`` then applies them."""
    config_spec, args = _split_config_spec(list(argv))
    overrides, rest = [], []
    i = 0
    while i < len(args):
        key, eq, value = args[i][2:].partition("=")
        if args[i].startswith("--config."):
            if not eq:  # "--config.x.y v" form
                if i + 1 >= len(args):
                    raise ConfigError(f"option '--{key}' has no value; write --{key}=VALUE.")
                value = args[i + 1]
                i += 1
            overrides.append((key[len("config."):], value))
        else:
            rest.append(args[i])
        i += 1
    return config_spec, overrides, rest


def _field_types(cls) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


# Fields that moved since an older layout: old dotted path -> new one. The execution fields and the router losses
# left the model section when it became the architecture alone; the model's family-specific fields went into
# subsections.
MOVED = {**{f"model.{name}": f"execution.{name}" for name in (
    "dtype", "remat", "attention", "attention_max_segments", "fp8", "fp8_skip_layers", "moe_mode", "capacity_factor")},
         "model.router_aux_loss": "train.router_aux_loss", "model.router_z_loss": "train.router_z_loss",
         **{f"model.{old}": f"model.{new}" for old, new in FLAT_MODEL_FIELDS.items()}}


def migrate(values: Mapping[str, Any], warn: bool = False) -> dict[str, Any]:
    """A nested config mapping with fields of an older layout (a checkpoint's saved config, an older config file)
    moved to where they live now; a value set at the new place wins. ``warn``: log each move (a config file)."""
    out = _copy(values)
    for old, new in MOVED.items():
        *old_parents, old_name = old.split(".")
        parent = _walk(out, old_parents)
        if not isinstance(parent, dict) or old_name not in parent or isinstance(parent[old_name], dict):
            continue  # absent, or the name of a subsection now (model.attention): nothing to move
        value = parent.pop(old_name)
        *new_parents, new_name = new.split(".")
        target = out
        for name in new_parents:
            target = target.setdefault(name, {})
            if not isinstance(target, dict):
                break
        else:
            target.setdefault(new_name, value)
        if warn:
            log.warning("config field '%s' is now '%s'; rename it in the config file", old, new)
    return out


def _copy(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in values.items()}


def _walk(tree: Any, names: Sequence[str]) -> Any:
    for name in names:
        tree = tree.get(name) if isinstance(tree, dict) else None
    return tree


def field_type(path: str) -> type:
    """The type of a dotted field path such as 'train.steps' or 'model.rope.theta'; ConfigError if it does not
    exist (or names a subsection rather than a field)."""
    if path in MOVED:
        raise ConfigError(f"config field '{path}' is now '{MOVED[path]}'; set --config.{MOVED[path]} instead.")
    section, *names = path.split(".")
    if section not in SECTIONS:
        raise ConfigError(f"config section '{section}' does not exist; use one of {', '.join(SECTIONS)}.")
    cls, where = SECTIONS[section], section
    if not names:
        raise ConfigError(f"config section '{section}' cannot be set as a whole; set one of its fields with "
                          f"--config.{section}.<field>=VALUE.")
    for i, name in enumerate(names):
        types = _field_types(cls)
        if name not in types:
            close = difflib.get_close_matches(name, types, n=1)
            guess = f"'{where}.{close[0]}' (closest match) or another field" if close else "one of the fields"
            fields = sorted(n for n, t in types.items() if not dataclasses.is_dataclass(t))
            parts = sorted(n for n, t in types.items() if dataclasses.is_dataclass(t))
            also = f" (or a field of its subsections {', '.join(parts)})" if parts else ""
            raise ConfigError(f"config field '{path}' does not exist; use {guess} of '{where}': "
                              f"{', '.join(fields)}{also}.")
        kind, where = types[name], f"{where}.{name}"
        if dataclasses.is_dataclass(kind):
            if i == len(names) - 1:
                raise ConfigError(f"config subsection '{where}' cannot be set as a whole; set one of its fields with "
                                  f"--config.{where}.<field>=VALUE.")
            cls = kind
        elif i < len(names) - 1:
            raise ConfigError(f"config field '{path}' does not exist; '{where}' is a field, not a subsection.")
    return kind


def _coerce(path: str, kind: type, value: Any) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is bool and isinstance(value, bool) or kind is not bool and type(value) is kind:
        return value
    raise ConfigError(f"config field '{path}' must be {kind.__name__} but is {type(value).__name__} "
                      f"({value!r}); fix it in the config file or with --config.{path}.")


def _not_a_section(where: str, content: Any) -> ConfigError:
    kind = "section" if "." not in where else "subsection"
    return ConfigError(f"config {kind} '{where}' must hold fields, not {content!r}; make it a dict of "
                       "fields in the config file.")


def from_mapping(values: Mapping[str, Any], named_family: bool | None = None) -> Config:
    """Builds and validates a Config from a nested mapping (e.g. ``ConfigDict.to_dict()``); fields of an older
    layout are moved to their place first (``migrate``). A config that names no ``model.family`` (written before
    the field; ``named_family`` False, or by default no such key in ``values``) gets the family its fields had by
    the rule of that time (``older_family``), said in the log."""
    sections = {}
    for section, content in migrate(values).items():
        if section not in SECTIONS:
            raise ConfigError(f"config section '{section}' does not exist; use one of {', '.join(SECTIONS)}.")
        sections[section] = _build(section, SECTIONS[section], content)
    cfg = Config(**sections)
    if named_family is None:
        named_family = "family" in (values.get("model") or {})
    if named_family:
        return cfg
    family = older_family(cfg.model)
    log.info("model.family is not set (a config written before the field): %r, as export told it from the model's "
             "fields then; set --config.model.family to name it", family)
    return replace(cfg, model=replace(cfg.model, family=family))


def _build(where: str, cls: type, content: Any) -> Any:
    """The dataclass ``cls`` from a mapping of its fields (and of its subsections' fields), each checked for type."""
    if not isinstance(content, Mapping):
        raise _not_a_section(where, content)
    kwargs = {}
    for name, value in content.items():
        path = f"{where}.{name}"
        types = _field_types(cls)
        kind = types[name] if name in types else field_type(path)  # field_type names an unknown field
        kwargs[name] = _build(path, kind, value) if dataclasses.is_dataclass(kind) else _coerce(path, kind, value)
    return cls(**kwargs)
