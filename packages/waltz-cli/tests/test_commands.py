"""The `waltz` command tree: commands come from the plugins' descriptors and are loaded
only when chosen; a command a plugin adds to another's group, a failing plugin, a
command that is not installed."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from collections.abc import Callable

import click
import pytest
from click.testing import CliRunner

from waltz_api.hookspecs import CommandDescriptor
from waltz_api.plugins import get_registry
from waltz_cli import PluginCommands, load_all, main


def tree(*descriptors: CommandDescriptor) -> click.Group:
    @click.group(cls=PluginCommands, commands=lambda: descriptors)
    def root() -> None:
        """A test root."""

    return root


def counting(command: click.Command, calls: list[str]) -> Callable[[], click.Command]:
    def load() -> click.Command:
        calls.append(command.name or "?")
        return command

    return load


@click.group("things")
def things() -> None:
    """Things, each with its own subcommand."""


@things.command("own")
def own() -> None:
    """The group's own subcommand."""
    click.echo("own ran")


@click.command("extra")
@click.option("--n", type=int, default=1)
def extra(n: int) -> None:
    """A subcommand another plugin adds."""
    click.echo(f"extra ran {n}")


@click.command("hello")
def hello() -> None:
    """Say hello."""
    click.echo("hello ran")


def test_help_lists_the_commands_without_loading_any() -> None:
    calls: list[str] = []
    root = tree(
        CommandDescriptor("hello", counting(hello, calls), "Say hello."),
        CommandDescriptor("things", counting(things, calls), "Things, each with its own."),
        CommandDescriptor("extra", counting(extra, calls), "Added.", group="things"),
    )
    result = CliRunner().invoke(root, ["--help"])
    assert result.exit_code == 0, result.output
    assert "hello   Say hello." in result.output
    assert "things  Things, each with its own." in result.output
    assert calls == []
    result = CliRunner().invoke(root, ["hello"])
    assert (result.exit_code, result.output) == (0, "hello ran\n")
    assert calls == ["hello"], "only the chosen command is loaded"


def test_a_command_added_to_another_plugins_group_comes_with_the_group() -> None:
    calls: list[str] = []
    root = tree(
        CommandDescriptor("things", counting(things, calls), "Things."),
        CommandDescriptor("extra", counting(extra, calls), "Added.", group="things"),
    )
    result = CliRunner().invoke(root, ["things", "--help"])
    assert result.exit_code == 0, result.output
    assert "own" in result.output and "extra" in result.output
    assert CliRunner().invoke(root, ["things", "extra", "--n", "3"]).output == "extra ran 3\n"
    assert CliRunner().invoke(root, ["things", "own"]).output == "own ran\n"
    assert sorted(calls) == ["extra", "things"], "each loaded once"


def test_a_group_no_installed_plugin_offers_still_holds_the_commands_added_to_it() -> None:
    root = tree(CommandDescriptor("extra", lambda: extra, "Added.", group="storage"))
    assert "storage" in CliRunner().invoke(root, ["--help"]).output
    assert CliRunner().invoke(root, ["storage", "extra"]).output == "extra ran 1\n"


def test_a_command_that_fails_to_load_is_one_error_line_naming_it() -> None:
    def broken() -> click.Command:
        raise ModuleNotFoundError("No module named 'aiohttp'")

    root = tree(
        CommandDescriptor("console", broken, "A console."),
        CommandDescriptor("hello", lambda: hello, "Say hello."),
    )
    assert "console" in CliRunner().invoke(root, ["--help"]).output
    result = CliRunner().invoke(root, ["console"])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert "error: the command `waltz console`" in result.stderr
    assert "test_commands" in result.stderr and "aiohttp" in result.stderr
    assert CliRunner().invoke(root, ["hello"]).output == "hello ran\n", "the others still work"


def test_a_load_function_returning_no_command_is_an_error() -> None:
    root = tree(CommandDescriptor("odd", lambda: "not a command", "Odd."))  # type: ignore[arg-type,return-value]
    result = CliRunner().invoke(root, ["odd"])
    assert result.exit_code == 1
    assert "is str, not a click command" in result.stderr


def test_a_first_party_command_not_installed_names_its_package() -> None:
    root = tree(CommandDescriptor("hello", lambda: hello, "Say hello."))
    result = CliRunner().invoke(root, ["console", "--coordination", "x"])
    assert result.exit_code == 1
    assert "`waltz console` is not installed: it comes with waltz-console" in result.stderr
    typo = CliRunner().invoke(root, ["helo"])
    assert typo.exit_code == 2
    assert "No such command 'helo'" in typo.stderr


def test_every_installed_command_is_listed_with_its_own_first_line() -> None:
    """A descriptor's short help is what `waltz --help` shows without loading the
    command: it must say what the command's own help says."""
    descriptors = get_registry().commands()
    paths = {d.path for d in descriptors}
    assert {"cluster", "server", "storage", "dev", "client", "perf", "keys", "plugins"} <= paths
    assert {"storage verify", "storage dump-segment", "simulate", "console", "spark"} <= paths
    loaded = load_all(main)
    for descriptor in descriptors:
        group = loaded.commands[descriptor.group] if descriptor.group else loaded
        assert isinstance(group, click.Group)
        command = group.commands[descriptor.name]
        own = " ".join(inspect.cleandoc(command.help or "").split())
        assert own.startswith(" ".join(descriptor.short_help.split())), descriptor.path


def test_waltz_help_imports_no_command_and_no_implementation() -> None:
    """`waltz --help` reads the plugins' descriptors only (issue 16: it took 0.44-0.72 s
    when every plugin and command module was imported)."""
    script = (
        "import sys\n"
        "from waltz_cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(__import__('json').dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    help_text, _, modules_line = done.stdout.rpartition("\n[")
    modules = json.loads("[" + modules_line)
    for name in (
        "cluster",
        "storage",
        "dev",
        "client",
        "perf",
        "simulate",
        "console",
        "spark",
        "keys",
    ):
        assert f"\n  {name} " in help_text, name
    heavy = (
        "waltz_server.cli.",
        "waltz_server.server",
        "waltz_storage_node.node",
        "waltz_storage_node.command",
        "waltz_storage_node.cli",
        "waltz_storage_node.main",
        "waltz_dev.dev",
        "waltz_dev.command",
        "waltz_client.cli",
        "waltz_client.client",
        "waltz_storage_fs.cli",
        "waltz_storage_fs.engine",
        "waltz_transport_zmq.cli",
        "waltz_sim.cli",
        "waltz_console.cli",
        "waltz_bank.spark_cli",
        "waltz_api.cluster",
        "waltz_api.wire",
        "aiohttp",
        "kazoo",
        "zmq",
        "pyspark",
        "rich",
    )
    loaded = [m for m in modules if m.startswith(heavy)]
    assert not loaded, loaded


@pytest.mark.parametrize("argv", [["--version"], ["plugins", "list", "-o", "json"]])
def test_the_console_script_runs(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "waltz_cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
