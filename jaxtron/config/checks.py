"""The checks every config section uses: one ``ConfigError`` sentence naming the field and the fix."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad user configuration; the message is one sentence naming the field and the fix."""


def _check(ok: bool, field: str, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"config field '{field}' {problem}; {fix}.")


def _positive(value: float, field: str) -> None:
    _check(value > 0, field, f"must be positive (got {value})", f"set --config.{field} to a value > 0")


def _non_negative(value: float, field: str) -> None:
    _check(value >= 0, field, f"must be >= 0 (got {value})", f"set --config.{field} to a value >= 0")


def _choice(value: str, field: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, field, f"is {value!r}, which is not one of {', '.join(map(repr, choices))}",
           f"set --config.{field} to one of those")


def jsonl_records(path: str, name: str, fix: str, log_file: bool = False):
    """(line number, record) of each non-blank line of the JSON Lines file ``path``; a ConfigError "``name`` line N
    is not JSON; ``fix``." for a line that is not. ``log_file``: an append-only log, whose last line a kill may
    have cut; that one is left out with a warning. (The callers check the records' fields with their own words.)"""
    import json

    from jaxtron.common.files import jsonl_lines

    if log_file:
        lines = jsonl_lines(path)
    else:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except ValueError:
            raise ConfigError(f"{name} line {number} is not JSON; {fix}.") from None
