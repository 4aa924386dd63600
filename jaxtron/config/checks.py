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
