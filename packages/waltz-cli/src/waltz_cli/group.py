"""The ``waltz`` command tree: a root group whose commands come from the plugins.

Every installed package contributes its commands through the ``waltz_cli_commands``
hook (:class:`~waltz_api.hookspecs.CommandDescriptor`). The root lists them from
their descriptors (``waltz --help`` imports no command module) and loads one when
it is chosen; a command contributed to another plugin's group (``storage verify``)
is loaded with that group.

Errors: a WaltzError ends the command with one clear line on stderr and exit code
1; an UnavailableError (the cluster did not answer within ``--timeout``, or refused
the connection) with exit code 4 (:mod:`waltz_cli.deadline`); a usage error (unknown
option, missing argument, bad value) is one line too, naming the ``--help`` to read,
with exit code 2 as click gives it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import click

from waltz_api.errors import UnavailableError, WaltzError
from waltz_cli.deadline import UNAVAILABLE_EXIT_CODE

if TYPE_CHECKING:
    from waltz_api.hookspecs import CommandDescriptor

log = logging.getLogger(__name__)

PROVIDERS = {
    "acl": "waltz-server",
    "cluster": "waltz-server",
    "server": "waltz-server",
    "storage": "waltz-server",
    "dev": "waltz-server",
    "archive": "waltz-server",
    "client": "waltz-client",
    "perf": "waltz-client",
    "keys": "waltz-transport-zmq",
    "console": "waltz-console",
    "simulate": "waltz-sim",
    "chaos": "waltz-chaos",
    "spark": "'waltz-example-bank[spark]'",
}
"""Which package brings each first-party command: named when it is not installed."""


def _usage_error(exc: click.UsageError) -> click.exceptions.Exit:
    """Print a usage error as one line (click prints usage, a hint and the error)."""
    where = exc.ctx.command_path if exc.ctx is not None else "waltz"
    click.echo(f"error: {exc.format_message()} (see '{where} --help')", err=True)
    return click.exceptions.Exit(exc.exit_code)


class WaltzGroup(click.Group):
    """A click group that turns a WaltzError into one line and exit code 1, and a
    usage error anywhere below it into one line and exit code 2."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as exc:
            raise _usage_error(exc) from exc

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except WaltzError as exc:
            click.echo(f"error: {_one_line(exc)}", err=True)
            ctx.exit(UNAVAILABLE_EXIT_CODE if isinstance(exc, UnavailableError) else 1)
        except click.UsageError as exc:
            raise _usage_error(exc) from exc


def _one_line(error: BaseException) -> str:
    """An error's message on one line (a multi-line message is joined)."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


def registered_commands() -> list[CommandDescriptor]:
    """The commands the installed plugins contribute (the process-wide registry)."""
    from waltz_api.plugins import get_registry

    return get_registry().commands()


class PluginCommands(WaltzGroup):
    """The root group: its commands are the plugins' (``commands`` is asked on first
    use, by default the process-wide registry's), each loaded when chosen."""

    def __init__(
        self,
        *args: Any,
        commands: Callable[[], Iterable[CommandDescriptor]] = registered_commands,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._find = commands
        self._top: dict[str, CommandDescriptor] | None = None
        self._nested: dict[str, list[CommandDescriptor]] = {}

    def _contributed(self) -> dict[str, CommandDescriptor]:
        if self._top is None:
            top: dict[str, CommandDescriptor] = {}
            nested: dict[str, list[CommandDescriptor]] = {}
            for descriptor in self._find():
                if descriptor.group:
                    nested.setdefault(descriptor.group, []).append(descriptor)
                elif descriptor.name in self.commands:
                    log.error(
                        "command %r of %s is ignored: `waltz` has its own",
                        descriptor.name,
                        descriptor.origin,
                    )
                else:
                    top[descriptor.name] = descriptor
            self._top, self._nested = top, nested
        return self._top

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self._contributed(), *self._orphans()})

    def _orphans(self) -> list[str]:
        """Groups that plugins add commands to but no installed plugin offers."""
        top = self._contributed()
        return [group for group in self._nested if group not in top and group not in self.commands]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        found = self.commands.get(cmd_name)
        if found is not None:
            return found
        descriptor = self._contributed().get(cmd_name)
        if descriptor is not None:
            command = _load(descriptor)
        elif cmd_name in self._orphans():
            command = click.Group(
                cmd_name, help=f"Commands the installed plugins add to `waltz {cmd_name}`."
            )
        else:
            return None
        for child in self._nested.get(cmd_name, []):
            if not isinstance(command, click.Group):
                log.error(
                    "command %r of %s is ignored: `waltz %s` is not a group",
                    child.name,
                    child.origin,
                    cmd_name,
                )
            elif child.name in command.commands:
                log.error(
                    "command %r of %s is ignored: `waltz %s` has its own",
                    child.name,
                    child.origin,
                    cmd_name,
                )
            else:
                command.add_command(_load(child), child.name)
        self.add_command(command, cmd_name)
        return command

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name = args[0] if args else ""
        if name in PROVIDERS and name not in self.list_commands(ctx):
            raise WaltzError(
                f"`waltz {name}` is not installed: it comes with {PROVIDERS[name]} "
                f"(pip install {PROVIDERS[name]})"
            )
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands and their one-line help, from the descriptors: nothing loaded."""
        rows = []
        limit = formatter.width - 6 - max((len(n) for n in self.list_commands(ctx)), default=0)
        for name in self.list_commands(ctx):
            loaded = self.commands.get(name)
            if loaded is not None:
                if loaded.hidden:
                    continue
                rows.append((name, loaded.get_short_help_str(limit)))
            elif name in self._contributed():
                # shortened as click shortens a loaded command's help
                stand_in = click.Command(name, help=self._contributed()[name].short_help)
                rows.append((name, stand_in.get_short_help_str(limit)))
            else:
                rows.append((name, f"Commands the installed plugins add to `waltz {name}`."))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _load(descriptor: CommandDescriptor) -> click.Command:
    try:
        command = descriptor.load()
    except Exception as exc:
        raise WaltzError(
            f"the command `waltz {descriptor.path}` ({descriptor.origin}) failed to load: "
            f"{type(exc).__name__}: {exc}; reinstall the package that offers it "
            "(`waltz plugins list` names them)"
        ) from exc
    if not isinstance(command, click.Command):
        raise WaltzError(
            f"the command `waltz {descriptor.path}` ({descriptor.origin}) is "
            f"{type(command).__name__}, not a click command"
        )
    return command


def load_all(group: click.Group, ctx: click.Context | None = None) -> click.Group:
    """``group`` with every contributed command loaded (for a reference of the whole tree
    or a walk over it): afterwards ``group.commands`` holds them all."""
    ctx = ctx or click.Context(group, info_name="waltz")
    for name in group.list_commands(ctx):
        group.get_command(ctx, name)
    return group


def quiet_client_libraries(verbose: int) -> None:
    """Coordination client libraries log every retry as a WARNING (kazoo: one line per
    attempt); the command's own error says what failed. ``-vv`` shows them."""
    if verbose < 2:
        logging.getLogger("kazoo").setLevel(logging.ERROR)
