"""``waltz plugins list``: the plugins this installation registers, by kind."""

from __future__ import annotations

import json
import subprocess
import sys

from click.testing import CliRunner

from waltz_api.hookspecs import PluginKind
from waltz_cli import main


def test_list_shows_the_installed_plugins_by_kind() -> None:
    result = CliRunner().invoke(main, ["plugins", "list", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    names = {(row["kind"], row["name"]) for row in rows}
    # what the workspace installs: the fs engine, the coordination plugins, zmq, lock tables
    for expected in [
        ("storage", "fs"),
        ("coordination", "local"),
        ("coordination", "zk"),
        ("coordination", "etcd"),
        ("transport", "zmq"),
    ]:
        assert expected in names, sorted(names)
    assert {row["kind"] for row in rows} <= {kind.value for kind in PluginKind}
    fs = next(row for row in rows if row["name"] == "fs")
    assert "crash_reopen" in fs["capabilities"] and fs["description"]
    local = next(row for row in rows if row["name"] == "local")
    assert "local" in local["uri_schemes"]

    human = CliRunner().invoke(main, ["plugins", "list"])
    assert human.exit_code == 0, human.output
    lines = human.stdout.splitlines()
    for kind in PluginKind:
        assert f"{kind.value}:" in lines
    storage = lines.index("storage:")
    assert any(line.split()[0] == "fs" for line in lines[storage + 1 : storage + 10])


def test_list_in_its_own_process_prints_no_load_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "waltz_cli", "plugins", "list"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "failed to load plugin" not in result.stderr
    assert "transport:" in result.stdout and "zmq" in result.stdout
