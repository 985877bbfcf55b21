"""Every usage error of the ``waltz`` CLI is one line on stderr and exit code 2."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from waltz_server.cli import main


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--bogus"], "No such option '--bogus'"),
        (["nosuch"], "No such command 'nosuch'"),
        (["cluster", "show", "--bogus"], "(see 'waltz cluster show --help')"),
        (["cluster", "create"], "Missing option '--coordination'"),
        (["storage", "dump-segment"], "Missing argument 'SEGMENT'"),
        (["client", "append", "--partition", "x"], "'x' is not a valid integer"),
        # a header beyond 32 bits (before: exit 1, from the client library)
        (
            "client append --header 99999999999 --data x --coordination local:///x".split(),  # noqa: SIM905
            "99999999999 is not in the range -2147483648<=x<=2147483647",
        ),
    ],
)
def test_a_usage_error_is_one_line_with_exit_code_2(args: list[str], expected: str) -> None:
    result = CliRunner().invoke(main, args, prog_name="waltz")
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and expected in lines[0]
    assert "--help" in lines[0]


def test_help_still_works() -> None:
    result = CliRunner().invoke(main, ["cluster", "--help"])
    assert result.exit_code == 0
    assert "Usage:" in result.output
