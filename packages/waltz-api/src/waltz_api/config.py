"""Configuration: one TOML file per process, every key overridable by environment.

A schema is a (nested) dataclass. :func:`load_config` reads the TOML file,
applies ``WALTZ_*`` environment overrides, converts and validates every value,
and raises :class:`~waltz_api.errors.ConfigError` naming the bad key.

Environment names: ``WALTZ_<KEY>`` for a top-level key and
``WALTZ_<SECTION>__<KEY>`` (double underscore) inside a section, upper-case:
``WALTZ_STORAGE__DATA_DIR=/mnt/waltz`` sets ``[storage] data_dir``, and inside an options
table ``WALTZ_STORAGE__OPTIONS__SEGMENT_SIZE=1048576`` sets ``[storage.options] segment_size``.

Environment values are text read as the field's type (``WALTZ_DEBUG=yes``,
``WALTZ_TIMEOUT=1.5``; for ``str | None`` the text stays a string). A list key
takes a TOML array or a comma-separated string (``WALTZ_HOSTS=a,b``), each item
read as the item type.

Field constraints go in field metadata: ``min``, ``max``, ``choices`` and
``help`` (the help text is used by the docs and ``waltz config``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args, get_origin

from waltz_api.errors import ConfigError

if TYPE_CHECKING:
    from waltz_api.hookspecs import OptionSpec

T = TypeVar("T")

ENV_PREFIX = "WALTZ_"


def load_config(
    schema: type[T],
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Build a ``schema`` instance from a TOML file, the environment and overrides.

    Precedence, lowest first: the schema's defaults, the file, ``WALTZ_*``
    environment variables, ``overrides`` (a nested mapping, e.g. from CLI flags).
    """
    raw: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        try:
            with file.open("rb") as handle:
                raw = tomllib.load(handle)
        except FileNotFoundError:
            raise ConfigError(f"config file {file} does not exist") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {file} is a directory, not a TOML file") from None
        except OSError as exc:
            raise ConfigError(f"config file {file} cannot be read: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"config file {file} is not valid TOML: it is not UTF-8 text ({exc.reason} "
                f"at byte {exc.start})"
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {file} is not valid TOML: {exc}") from None
    _apply_env(schema, raw, os.environ if env is None else env)
    if overrides:
        _deep_merge(raw, overrides)
    return _build(schema, raw, prefix="")


def config_from_mapping(schema: type[T], raw: Mapping[str, Any]) -> T:
    """Validate an in-memory mapping against ``schema`` (no file, no environment)."""
    return _build(schema, dict(raw), prefix="")


def describe(schema: type[Any], prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(key, type, default, help) of every key of ``schema``, for docs."""
    rows: list[tuple[str, str, Any, str]] = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            rows.extend(describe(typing.cast(type[Any], hint), prefix=f"{key}."))
            continue
        rows.append((key, _type_name(hint), _default_of(f), f.metadata.get("help", "")))
    return rows


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def toml_document(config: Mapping[str, Any]) -> str:
    """A TOML document of ``config`` (tables of str, int, float, bool, lists and tables):
    the config file of a process that a program starts (tests, ``waltz chaos``)."""

    def value(item: Any) -> str:
        if isinstance(item, bool):
            return "true" if item else "false"
        if isinstance(item, int | float):
            return repr(item)
        if isinstance(item, str):
            return '"' + item.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(item, list):
            return "[" + ", ".join(value(v) for v in item) + "]"
        raise TypeError(f"cannot write {item!r} as TOML")

    lines: list[str] = []

    def table(prefix: str, mapping: Mapping[str, Any]) -> None:
        scalars = {k: v for k, v in mapping.items() if not isinstance(v, Mapping)}
        tables = {k: v for k, v in mapping.items() if isinstance(v, Mapping)}
        if prefix:
            lines.append(f"[{prefix}]")
        lines.extend(f"{k} = {value(v)}" for k, v in scalars.items())
        for key, sub in tables.items():
            table(f"{prefix}.{key}" if prefix else key, sub)

    table("", config)
    return "\n".join(lines) + "\n"


def _deep_merge(target: dict[str, Any], source: Mapping[str, Any]) -> None:
    for key, value in source.items():
        if isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _deep_merge(target[key], value)
        else:
            target[key] = dict(value) if isinstance(value, Mapping) else value


def _apply_env(schema: type[Any], raw: dict[str, Any], env: Mapping[str, str]) -> None:
    hints = typing.get_type_hints(schema)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        if parts[0] not in fields:
            continue  # another component's variable (e.g. WALTZ_DISABLE_PLUGIN_AUTOLOAD)
        target = raw
        current_schema: Any = schema
        current_hints = hints
        for depth, part in enumerate(parts):
            known = {f.name for f in dataclasses.fields(current_schema)}
            if part not in known:
                key = ".".join(parts[: depth + 1])
                raise ConfigError(
                    f"environment variable {name} names unknown key {key!r}"
                    + _suggest(part, known),
                    key=key,
                )
            hint = current_hints[part]
            if depth == len(parts) - 1:
                if dataclasses.is_dataclass(hint):
                    key = ".".join(parts)
                    example = f"{name}__{dataclasses.fields(hint)[0].name.upper()}"
                    raise ConfigError(
                        f"environment variable {name} names the section {key!r}, not a key; "
                        f"set one of its keys instead, e.g. {example}",
                        key=key,
                    )
                target[part] = _EnvValue(value, name)
            elif dataclasses.is_dataclass(hint):
                target = target.setdefault(part, {})
                current_schema = hint
                current_hints = typing.get_type_hints(hint)
            elif _is_free_mapping(hint):
                sub = target.setdefault(part, {})
                sub["__".join(parts[depth + 1 :])] = _EnvValue(value, name)
                break
            else:
                key = ".".join(parts[: depth + 1])
                raise ConfigError(f"{name}: key {key!r} has no sub-keys", key=key)


@dataclasses.dataclass(frozen=True)
class _EnvValue:
    """Text to read as a field's type: an environment value, or one item of a
    comma-separated list (``variable`` is then None unless it came from the environment)."""

    text: str
    variable: str | None

    @property
    def source(self) -> str:
        return f" (from {self.variable})" if self.variable else ""


def _suggest(name: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(sorted(known))}"


def _build(schema: type[T], raw: Mapping[str, Any], prefix: str) -> T:
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{prefix.rstrip('.') or 'config'} must be a table, got {raw!r}",
            key=prefix.rstrip("."),
        )
    hints = typing.get_type_hints(schema)
    fields = {f.name: f for f in dataclasses.fields(typing.cast(Any, schema)) if f.init}
    for key in raw:
        if key not in fields:
            raise ConfigError(
                f"unknown config key {prefix + key!r}" + _suggest(key, fields),
                key=f"{prefix}{key}",
            )
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        key = f"{prefix}{name}"
        hint = hints[name]
        if name not in raw:
            if dataclasses.is_dataclass(hint) and f.default_factory is dataclasses.MISSING:
                kwargs[name] = _build(typing.cast(type[Any], hint), {}, f"{key}.")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"missing required config key {key!r}", key=key)
            continue
        value = raw[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(typing.cast(type[Any], hint), value, f"{key}.")
        else:
            kwargs[name] = _check(_convert(value, hint, key), f, key)
    try:
        return schema(**kwargs)
    except (ValueError, TypeError) as exc:
        where = prefix.rstrip(".") or "config"
        raise ConfigError(f"invalid {where}: {exc}", key=prefix.rstrip(".") or None) from None


def _check(value: Any, f: dataclasses.Field[Any], key: str) -> Any:
    meta = f.metadata
    if "min" in meta and value is not None and value < meta["min"]:
        raise ConfigError(f"config key {key!r} must be at least {meta['min']}, got {value}", key)
    if "max" in meta and value is not None and value > meta["max"]:
        raise ConfigError(f"config key {key!r} must be at most {meta['max']}, got {value}", key)
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(
            f"config key {key!r} must be one of {', '.join(map(str, meta['choices']))}, "
            f"got {value!r}",
            key,
        )
    return value


def _is_free_mapping(hint: Any) -> bool:
    return get_origin(hint) in (dict, Mapping) or hint in (dict, Mapping)


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _convert(value: Any, hint: Any, key: str) -> Any:
    source = ""
    origin = get_origin(hint)
    args = get_args(hint)
    if origin in (types.UnionType, typing.Union):
        # An environment value stays text here: each member of the union reads
        # it as its own type ("123" is a str for `str | None`, an int for `int | None`).
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError:
                continue
        shown, source = (value.text, value.source) if isinstance(value, _EnvValue) else (value, "")
        raise ConfigError(
            f"config key {key!r} must be {_type_name(hint)}, got {shown!r}{source}", key
        )
    if isinstance(value, _EnvValue):
        source = value.source
        if origin in (list, tuple) or hint in (list, tuple):
            parsed = _parse_env_text(value.text, Any)
            if not isinstance(parsed, list):
                # "a, b, c": each item is read as the item type, like a whole value.
                parsed = [
                    _EnvValue(item.strip(), value.variable)
                    for item in value.text.split(",")
                    if item.strip()
                ]
            value = parsed
        else:
            value = _parse_env_text(value.text, hint)
    try:
        if origin is Literal:
            if value not in args:
                raise ConfigError(
                    f"config key {key!r} must be one of {', '.join(map(repr, args))}, "
                    f"got {value!r}{source}",
                    key,
                )
            return value
        if hint is Any:
            return value
        if hint is bool:
            if isinstance(value, bool):
                return value
            raise TypeError
        if hint is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError
            return value
        if hint is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError
            return float(value)
        if hint is str:
            if not isinstance(value, str):
                raise TypeError
            return value
        if hint is Path:
            if not isinstance(value, str | Path):
                raise TypeError
            return Path(value).expanduser()
        if origin in (list, tuple) or hint in (list, tuple):
            if isinstance(value, str):
                # "a, b, c": each item is read as the item type.
                value = [_EnvValue(v.strip(), None) for v in value.split(",") if v.strip()]
            if not isinstance(value, list | tuple):
                raise TypeError
            item = args[0] if args else Any
            items = [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
            return tuple(items) if (origin is tuple or hint is tuple) else items
        if _is_free_mapping(hint):
            if not isinstance(value, Mapping):
                raise TypeError
            return {
                k: (_parse_env_text(v.text, Any) if isinstance(v, _EnvValue) else v)
                for k, v in value.items()
            }
    except TypeError:
        raise ConfigError(
            f"config key {key!r} must be {_type_name(hint)}, got {value!r}{source}", key
        ) from None
    raise ConfigError(f"config key {key!r} has an unsupported type {hint!r}", key)


def _parse_env_text(text: str, hint: Any) -> Any:
    """Environment values are strings: read them as the field's type."""
    stripped = text.strip()
    if hint is str or hint is Path:
        return text
    if hint is bool:
        lowered = stripped.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        return text
    try:
        return tomllib.loads(f"v = {stripped}")["v"]
    except tomllib.TOMLDecodeError:
        return text


# -- documentation ------------------------------------------------------------------------


def type_name(hint: Any) -> str:
    """A type as the docs write it: ``int``, ``list[int]``, ``str | None``, ``table``."""
    origin = get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return " | ".join(type_name(a) for a in get_args(hint))
    if hint is type(None):
        return "None"
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return "table"
    if origin in (list, tuple, Sequence):
        args = get_args(hint)
        return f"list[{type_name(args[0])}]" if args else "list"
    return str(getattr(hint, "__name__", hint)).replace("typing.", "")


def option_specs(schema: type[Any], meanings: Mapping[str, str] | None = None) -> list[OptionSpec]:
    """Every key of a config schema (a nested dataclass) as documented options.

    The meaning is the field's ``help`` metadata, else ``meanings[key]``; a key
    with neither raises ConfigError (document it). Its ``choices``, ``min`` and ``max``
    are added to the meaning."""
    from waltz_api.hookspecs import OptionSpec

    meanings = meanings or {}
    specs: list[OptionSpec] = []
    for key, _type, default, help_text in describe(schema):
        field, hint = _field_of(schema, key)
        meaning = help_text or meanings.get(key, "")
        if not meaning:
            raise ConfigError(
                f"config key {key!r} of {schema.__name__} has no help text: add "
                "metadata={'help': ...} to its field",
                key=key,
            )
        required = (
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        )
        extra = []
        if "choices" in field.metadata:
            extra.append("one of " + ", ".join(f"`{c}`" for c in field.metadata["choices"]))
        if "min" in field.metadata:
            extra.append(f"at least {field.metadata['min']}")
        if "max" in field.metadata:
            extra.append(f"at most {field.metadata['max']}")
        if extra:
            meaning = f"{meaning} ({'; '.join(extra)})"
        specs.append(OptionSpec(key, type_name(hint), default, meaning, required=required))
    return specs


def _field_of(schema: type[Any], key: str) -> tuple[dataclasses.Field[Any], Any]:
    current: Any = schema
    parts = key.split(".")
    for depth, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(current)}
        hint = typing.get_type_hints(current)[part]
        if depth == len(parts) - 1:
            return fields[part], hint
        current = hint
    raise KeyError(key)  # pragma: no cover - describe() only yields existing keys


def same_keys(what: str, code: Iterable[str], documented: Iterable[str]) -> None:
    """ConfigError when the options a component reads (``code``) and those it documents
    differ: a new option cannot go undocumented, a removed one cannot stay in the docs."""
    code, documented = set(code), set(documented)
    if code != documented:
        raise ConfigError(
            f"the {what} options changed: undocumented {sorted(code - documented)}, gone "
            f"{sorted(documented - code)}; update its option schema (waltz_option_schemas)"
        )
