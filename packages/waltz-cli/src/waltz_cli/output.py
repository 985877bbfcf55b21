"""``-o/--output json|table|text``: one option for every command that reads.

- ``text`` (the default): the command's own lines for a person;
- ``table``: the result's rows as aligned columns with a header (each list of
  records in the result becomes one table, titled with its key; true and false are
  ``yes`` and ``no``);
- ``json``: the result as JSON, for scripts (``--json`` still works: the same).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

OUTPUTS = ("text", "table", "json")
_JSON_ALIAS = "waltz.output_json"


def _json_alias(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    if value:
        ctx.meta[_JSON_ALIAS] = True
    return value


def output_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """Adds ``-o/--output`` (passed as ``output``) and the older ``--json`` (hidden)."""
    func = click.option(
        "--json",
        "json_alias",
        is_flag=True,
        hidden=True,
        expose_value=False,
        callback=_json_alias,
        help="The same as --output json.",
    )(func)
    return click.option(
        "-o",
        "--output",
        type=click.Choice(OUTPUTS),
        default="text",
        show_default=True,
        callback=_resolve,
        help="text for people, table (aligned columns), json for scripts.",
    )(func)


def _resolve(ctx: click.Context, param: click.Parameter, value: str) -> str:
    return "json" if ctx.meta.get(_JSON_ALIAS) else value


def output_is_json(output: str) -> bool:
    ctx = click.get_current_context(silent=True)
    return output == "json" or bool(ctx is not None and ctx.meta.get(_JSON_ALIAS))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"  # (not Python's True/False)
    if isinstance(value, dict | list | tuple):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return str(value)


def table(rows: list[dict[str, Any]], title: str | None = None) -> str:
    """Aligned columns (the keys of the rows, in first-seen order) with a header."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    if not columns:
        return f"{title}: (none)" if title else "(none)"
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = [f"{title}:"] if title else []
    lines.append("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def tables(result: Any) -> str:
    """``result`` as tables: a list of records is one table; a mapping shows its plain
    values as a two-column table, then each list of records under it as its own."""
    if isinstance(result, list):
        return table([r if isinstance(r, dict) else {"value": r} for r in result])
    if not isinstance(result, dict):
        return table([{"value": result}])
    plain = [{"key": k, "value": v} for k, v in result.items() if not _is_records(v)]
    parts = [table(plain)] if plain else []
    parts += [table(v, k) for k, v in result.items() if _is_records(v)]
    return "\n\n".join(parts)


def _is_records(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def emit(output: str, result: Any, text: Callable[[], None]) -> None:
    """Print ``result`` as ``output`` asks; ``text()`` prints the command's own lines."""
    if output_is_json(output):
        click.echo(json.dumps(result, indent=2))
    elif output == "table":
        click.echo(tables(result))
    else:
        text()


def emitted(output: str, result: Any) -> bool:
    """Print ``result`` as json or table and return True; False for text (the command
    prints its own lines then)."""
    if output_is_json(output) or output == "table":
        emit(output, result, lambda: None)
        return True
    return False
