"""Every command that needs the coordination service: a URI without a scheme is a usage
error with a hint, WALTZ_COORDINATION is in --help, and a malformed --write-lock is a
usage error (exit 2). (An unreachable service, refused or silent: test_cli_deadlines.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from waltz_server.cli import main as waltz_cli

pytestmark = pytest.mark.timeout(120)


def _waltz(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "waltz_server.cli", *args],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "WALTZ_COORDINATION"},
    )
    return done, time.monotonic() - started


def test_a_uri_without_a_scheme_is_a_usage_error_with_a_hint() -> None:
    for command in (["cluster", "show"], ["client", "tail"]):
        done, _ = _waltz(*command, "--coordination", "127.0.0.1:2181")
        assert done.returncode == 2, done.stderr
        assert "did you mean zk://127.0.0.1:2181/waltz?" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


def test_the_environment_variable_is_shown_in_help() -> None:
    for command in (["cluster", "show"], ["cluster", "create"], ["server", "list"]):
        result = CliRunner().invoke(waltz_cli, [*command, "--help"], terminal_width=200)
        assert result.exit_code == 0
        assert "env var: WALTZ_COORDINATION" in result.output, command
        assert "--timeout" in result.output, command


def test_a_malformed_write_lock_is_a_usage_error() -> None:
    done, _ = _waltz(
        "client", "append", "--coordination", "local:///nowhere", "--data", "x",
        "--write-lock", "no-id",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--write-lock" in done.stderr and "NAME:ID" in done.stderr


def test_every_option_read_from_the_environment_says_so_in_help() -> None:
    import click

    def walk(command: click.Command, path: str) -> list[str]:
        found = [
            f"{path} {param.name}"
            for param in command.params
            if isinstance(param, click.Option) and param.envvar and not param.show_envvar
        ]
        if isinstance(command, click.Group):
            for name in command.list_commands(click.Context(command)):
                sub = command.get_command(click.Context(command), name)
                if sub is not None and not type(sub).__name__.startswith("Lazy"):
                    found += walk(sub, f"{path} {name}")
        return found

    assert walk(waltz_cli, "waltz") == []
