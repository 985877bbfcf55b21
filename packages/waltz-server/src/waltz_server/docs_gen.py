"""The generated parts of the docs, so they keep matching the code.

- ``docs/operators.md``: the tables of every config key (server, storage node,
  client) and of every plugin's options, between
  ``<!-- generated: NAME -->`` and ``<!-- end generated -->`` markers;
- ``docs/cli.md``: the reference of every ``waltz`` command, from the click tree.

::

    python -m waltz_server.docs_gen [--root REPO]           # rewrite them
    python -m waltz_server.docs_gen [--root REPO] --check   # exit 1 when they are stale

The option tables are those the installed plugins contribute through the
``waltz_option_schemas`` hook (each plugin documents its own options: a key without
a meaning is an error, so a new key cannot go undocumented); the command reference
is the whole ``waltz`` tree, every installed plugin's commands
(``waltz_cli_commands``).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import logging
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from waltz_api.config import option_specs
from waltz_api.errors import ConfigError
from waltz_api.hookspecs import OptionSchema, OptionSpec

log = logging.getLogger(__name__)

BEGIN = "<!-- generated: {name} (python -m waltz_server.docs_gen) -->"
END = "<!-- end generated -->"
MIB = 1024 * 1024
_UNSET: Any = getattr(click.core, "UNSET", object())
"""click 8.2+ marks a parameter without a default with this sentinel."""


Row = OptionSpec
"""One documented key: ``key`` (dotted), its type, default and meaning."""


# -- formatting -------------------------------------------------------------------------


def format_default(value: Any, *, required: bool = False) -> str:
    """A default as a TOML-like literal (``8388608`` gets ``(8 MiB)``)."""
    if required:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and value >= MIB and value % MIB == 0:
        size = value // MIB
        human = f"{size // 1024} GiB" if size % 1024 == 0 else f"{size} MiB"
        return f"`{value}` ({human})"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, list | tuple):
        return "`[" + ", ".join(format_default(v).strip("`") for v in value) + "]`"
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def table(rows: Iterable[Row], *, env_prefix: str | None = "WALTZ_") -> str:
    """A markdown table of ``rows``; with ``env_prefix``, a column with each key's variable."""
    header = "| key | type | default | meaning |"
    rule = "|---|---|---|---|"
    if env_prefix is not None:
        header += " environment |"
        rule += "---|"
    lines = [header, rule]
    for row in rows:
        line = (
            f"| `{row.key}` | {_cell(row.type)} | "
            f"{format_default(row.default, required=row.required)} | {_cell(row.meaning)} |"
        )
        if env_prefix is not None:
            variable = env_prefix + row.key.upper().replace(".", "__")
            if row.type == "table":
                variable += "__<OPTION>"
            line += f" `{variable}` |"
        lines.append(line)
    return "\n".join(lines) + "\n"


# -- the option tables ---------------------------------------------------------------------


schema_rows = option_specs
"""Every key of a config schema (a nested dataclass): see :func:`waltz_api.config.option_specs`."""


def render(schema: OptionSchema) -> str:
    """The markdown of one option table: a config file's keys with their environment
    variables, or a component's options (or the line saying it takes none)."""
    rows = list(schema.load())
    if schema.environment:
        return table(rows)
    if not rows:
        return "No options (an option given is refused).\n"
    return table(rows, env_prefix=None)


def option_sections() -> dict[str, Callable[[], str]]:
    """Every option table the installed plugins contribute (``waltz_option_schemas``)."""
    from waltz_api.plugins import get_registry

    return {
        schema.name: functools.partial(render, schema) for schema in get_registry().option_schemas()
    }


def fill_sections(text: str, sections: Mapping[str, Callable[[], str]] | None = None) -> str:
    """``text`` with every generated region replaced; every section must have a region,
    and every region a section (a plugin that is not installed leaves its region stale)."""
    if sections is None:
        sections = option_sections()
    for name in re.findall(re.escape(BEGIN).replace(r"\{name\}", r"(\S+)"), text):
        if name not in sections:
            raise ConfigError(
                f"the docs have a region {name!r} that no installed plugin contributes "
                "(waltz_option_schemas): install it, or remove the region"
            )
    for name, make in sections.items():
        begin = BEGIN.format(name=name)
        pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(END), re.DOTALL)
        if not pattern.search(text):
            raise ConfigError(f"the docs have no region {begin!r} ... {END!r}")
        replacement = f"{begin}\n{make()}{END}"
        text = pattern.sub(lambda _match: replacement, text, count=1)  # noqa: B023 - used at once
    return text


# -- the CLI reference --------------------------------------------------------------------


def _help_text(command: click.Command) -> str:
    text = inspect.cleandoc(command.help or command.short_help or "")
    lines = [line for line in text.splitlines() if line.strip() != "\b"]
    return "\n".join(line.rstrip() for line in lines)


def _param_names(param: click.Parameter) -> str:
    if isinstance(param, click.Option):
        names = [*param.opts, *param.secondary_opts]
        if param.is_flag and param.secondary_opts:
            names = ["/".join(param.opts + param.secondary_opts)]
        return ", ".join(f"`{n}`" for n in names)
    return f"`{(param.human_readable_name or '').upper()}`"


def _param_type(param: click.Parameter) -> str:
    if isinstance(param, click.Option) and param.is_flag:
        return "flag"
    kind = param.type
    if isinstance(kind, click.Choice):
        return " \\| ".join(str(c) for c in kind.choices)
    name = str(kind.name)
    if isinstance(kind, click.IntRange | click.FloatRange):
        name = f"{name} {kind._describe_range()}"
    elif param.metavar:
        name = param.metavar
    if param.multiple:
        name += ", repeatable"
    if getattr(param, "nargs", 1) == -1:
        name += " ..."
    return name


def _param_default(param: click.Parameter) -> str:
    if param.required:
        return "required"
    default = param.default
    if default is None or default is _UNSET or (param.multiple and not default):
        return ""
    if callable(default):
        return "computed"
    if isinstance(param, click.Option) and param.is_flag:
        return "on" if default is True else ""
    return f"`{default}`"


def _param_help(param: click.Parameter) -> str:
    text = getattr(param, "help", None) or ""
    envvar = getattr(param, "envvar", None)
    if envvar:
        names = [envvar] if isinstance(envvar, str) else list(envvar)
        text = f"{text} (env: {', '.join(f'`{n}`' for n in names)})".strip()
    return _cell(text)


def command_reference(group: click.Command, prog: str = "waltz") -> str:
    """Markdown for ``group`` and every subcommand below it, depth first, sorted by name."""
    out: list[str] = []

    def walk(command: click.Command, path: list[str], parent: click.Context | None) -> None:
        ctx = click.Context(command, info_name=path[-1], parent=parent)
        name = " ".join(path)
        out.append(f"{'#' * min(len(path) + 1, 4)} `{name}`\n")
        usage = " ".join(command.collect_usage_pieces(ctx))
        out.append(f"```text\n{name} {usage}\n```\n")
        help_text = _help_text(command)
        if help_text:
            out.append(help_text + "\n")
        params = [
            p
            for p in command.get_params(ctx)
            if not getattr(p, "hidden", False) and "--help" not in getattr(p, "opts", ())
        ]
        if params:
            out.append("| parameter | type | default | meaning |")
            out.append("|---|---|---|---|")
            for param in params:
                out.append(
                    f"| {_param_names(param)} | {_cell(_param_type(param))} | "
                    f"{_param_default(param)} | {_param_help(param)} |"
                )
            out.append("")
        if isinstance(command, click.Group):
            for sub_name in sorted(command.commands):
                sub = command.commands[sub_name]
                if not getattr(sub, "hidden", False):
                    walk(sub, [*path, sub_name], ctx)

    walk(group, [prog], None)
    return "\n".join(out).rstrip("\n") + "\n"


def command_names(group: click.Command, prog: str = "waltz") -> list[str]:
    """Every command path below ``group`` (``waltz storage list``...), sorted."""
    names: list[str] = []

    def walk(command: click.Command, path: list[str]) -> None:
        names.append(" ".join(path))
        if isinstance(command, click.Group):
            for sub_name in sorted(command.commands):
                walk(command.commands[sub_name], [*path, sub_name])

    walk(group, [prog])
    return names


CLI_INTRO = """\
# `waltz` command reference

Generated from the click command tree by `python -m waltz_server.docs_gen`
(`packages/waltz-server/tests/test_docs.py` fails when it is stale), with every
package of the workspace installed: each command comes from the package that
offers it (`waltz plugins list`, the `waltz_cli_commands` hook), so an installation
has the commands of what it installed. Every
command exits 0 on success, 1 with one `error: ...` line on stderr on any
error, 2 on a usage error, and 4 (with one `error: ...` line) when the cluster
did not answer in time. `waltz -v` logs at INFO (the client library's warnings
too), `-vv` at DEBUG; `--help` on any command prints its usage.

Every command that talks to a cluster (its coordination service, a server or a
storage node) takes `--timeout SECONDS`, 10 by default, and ends within it when
what it waits for does not answer: exit code 4. A connection refused at once
(nothing listens at the address) is reported at once. `client tail` and `perf`
count the timeout from their last progress; `storage scrub`, `storage snapshot`,
`archive verify` and `archive restore --url` bound reaching the cluster by it,
then take as long as the data. A `local://` coordination location that does not
exist is refused (exit 1), naming the path: only `cluster create` makes one.

"""


def cli_markdown() -> str:
    """The reference of the whole ``waltz`` tree: every installed plugin's commands."""
    from waltz_cli import load_all, main

    return CLI_INTRO + command_reference(load_all(main))


# -- files ----------------------------------------------------------------------------------


def generated_files(root: Path) -> dict[Path, str]:
    """Each generated file under ``root`` and the text it should have."""
    operators = root / "docs" / "operators.md"
    return {
        operators: fill_sections(operators.read_text(encoding="utf-8")),
        root / "docs" / "cli.md": cli_markdown(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m waltz_server.docs_gen", description=__doc__)
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository root")
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stale = []
    for path, text in generated_files(args.root).items():
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text, encoding="utf-8")
            log.info("wrote %s", path)
    if args.check and stale:
        for path in stale:
            log.error("stale: %s (run python -m waltz_server.docs_gen)", path)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
