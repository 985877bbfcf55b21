"""Validation of a lock table's options mapping (shared by the built-in tables)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from waltz_api.errors import ConfigError
from waltz_api.types import NO_TRANSACTION


def check_option_names(table: str, options: Mapping[str, Any], known: frozenset[str]) -> None:
    """Reject an option ``table`` does not know, naming it and the valid ones."""
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(str(name), sorted(known), n=1)
            hint = (
                f"; did you mean {close[0]!r}?"
                if close
                else f"; valid options: {', '.join(sorted(known)) or '(none)'}"
            )
            raise ConfigError(f"unknown option {name!r} for the {table} lock table{hint}", key=name)


def check_int_option(table: str, name: str, value: Any, *, minimum: int, maximum: int) -> int:
    """``value`` as an int within [minimum, maximum], or a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"option {name!r} of the {table} lock table must be an integer, got {value!r}",
            key=name,
        )
    if not minimum <= value <= maximum:
        raise ConfigError(
            f"option {name!r} of the {table} lock table must be between {minimum} and "
            f"{maximum}, got {value}",
            key=name,
        )
    return value


def check_high_water_mark(value: Any) -> int:
    """A high-water mark: an int, at least NO_TRANSACTION (-1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < NO_TRANSACTION:
        raise ValueError(
            f"a lock table high-water mark must be an integer >= {NO_TRANSACTION}, got {value!r}"
        )
    return value
