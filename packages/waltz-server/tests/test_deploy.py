"""deploy/: the alert rules (promtool), the dashboard's and the rules' metric names
(against what the code exports), the systemd units (systemd-analyze verify), the
configs (the real loaders), the compose file (docker compose config, where
docker compose is installed; a visible skip otherwise) and the image (built and run
where a container engine answers; a visible skip otherwise: `tox -e dist` replays its
install script, .ci/distcheck/image.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from waltz_server.cli import main as waltz_cli
from waltz_server.observability import exported_families as server_families
from waltz_server.server.config import load_server_config
from waltz_storage_node.config import load_storage_config
from waltz_storage_node.metrics import exported_families as storage_families

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "waltz-alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "waltz-alerts.test.yml"
DASHBOARD = DEPLOY / "grafana" / "waltz-dashboard.json"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
COMPOSE = DEPLOY / "compose.yaml"

METRIC = re.compile(r"\b(?:waltz|process)_[a-z0-9_]+\b")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
PROCESS_METRICS = {"process_resident_memory_bytes", "process_cpu_seconds_total"}
NOT_CHARTED = {
    # read per partition by operators (`waltz storage list`), not worth a chart
    "waltz_storage_low_water_mark",
    "waltz_storage_filesystem_size_bytes",
}


def exported_families() -> dict[str, str]:
    """What a server and a storage node export, together."""
    return server_families() | storage_families()


def _tool(name: str) -> str:
    """The path of ``name``; fails in CI (.ci/run installs it), skips visibly elsewhere."""
    found = shutil.which(name)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed; .ci/run installs it")
        pytest.skip(f"{name} is not installed (CI installs it): not checked here")
    return found


def _named_metrics(text: str) -> set[str]:
    names = set()
    exported = exported_families()
    for found in METRIC.findall(text):
        name = found
        for suffix in HISTOGRAM_SUFFIXES:
            base = found.removesuffix(suffix)
            if base != found and exported.get(base) == "histogram":
                name = base
        names.add(name)
    return names


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


def test_alert_rules_pass_promtool() -> None:
    promtool = _tool("promtool")
    checked = subprocess.run(
        [promtool, "check", "rules", str(RULES)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # the alerts fire when they should (and not before): promtool's rule unit tests
    tested = subprocess.run(
        [promtool, "test", "rules", RULE_TESTS.name],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=RULE_TESTS.parent,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_dashboard_and_rules_name_only_exported_metrics() -> None:
    exported = set(exported_families())
    queries = _dashboard_queries()
    assert len(queries) >= 15
    for where, text in (("dashboard", "\n".join(queries)), ("alert rules", RULES.read_text())):
        unknown = _named_metrics(text) - exported - PROCESS_METRICS
        assert not unknown, f"the {where} query metrics the code does not export: {unknown}"


def test_every_exported_metric_is_charted_or_alerted() -> None:
    used = _named_metrics("\n".join(_dashboard_queries())) | _named_metrics(RULES.read_text())
    missing = set(exported_families()) - used - NOT_CHARTED
    assert not missing, f"exported but neither on the dashboard nor in a rule: {missing}"


def test_dashboard_is_importable() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["uid"] and dashboard["title"] == "Waltz"
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


@pytest.mark.parametrize("unit", UNITS, ids=[u.name for u in UNITS])
def test_systemd_units_verify(unit: Path, tmp_path: Path) -> None:
    analyze = _tool("systemd-analyze")
    waltz = Path(sys.executable).parent / "waltz"
    assert waltz.exists(), waltz
    text = unit.read_text(encoding="utf-8")
    # each role's venv (docs/operators.md): /opt/waltz a server's, /opt/waltz-storage a
    # storage node's
    venv = {"waltz-server.service": "/opt/waltz", "waltz-storage.service": "/opt/waltz-storage"}
    assert f"ExecStart={venv[unit.name]}/bin/waltz " in text
    # the installed `waltz` of this environment stands in for the venv's
    copy = tmp_path / unit.name
    copy.write_text(text.replace(f"{venv[unit.name]}/bin/waltz", str(waltz)), encoding="utf-8")
    verified = subprocess.run(
        [analyze, "verify", "--man=no", str(copy)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert verified.returncode == 0 and not verified.stderr.strip(), verified.stderr
    # the command line is one the CLI accepts
    command = re.search(r"^ExecStart=\S+ (.+)$", text, re.MULTILINE)
    assert command is not None
    words = command.group(1).split()
    result = CliRunner().invoke(waltz_cli, [*words[: words.index("--config")], "--help"])
    assert result.exit_code == 0, result.output


def test_example_configs_load() -> None:
    storage = load_storage_config(DEPLOY / "config" / "storage.toml", env={})
    assert storage.http.enabled and storage.log_format == "json"
    server = load_server_config(DEPLOY / "config" / "server.toml", env={})
    assert server.http.enabled and server.coordination.uri.startswith("zk://")


def test_compose_commands_are_waltz_commands() -> None:
    text = COMPOSE.read_text(encoding="utf-8")
    for service in ("zookeeper", "storage1", "storage2", "storage3", "server1", "server2"):
        assert re.search(rf"^  {service}:$", text, re.MULTILINE), service
    commands = re.findall(r"^    command: (?:>-\n((?:      .+\n)+)|(.+)\n)", text, re.MULTILINE)
    assert len(commands) >= 6
    for folded, single in commands:
        words = (folded or single).split()
        head = words[: words.index("--config")] if "--config" in words else words[:2]
        result = CliRunner().invoke(waltz_cli, [*head, "--help"])
        assert result.exit_code == 0, (words, result.output)


def test_compose_file_passes_docker_compose_config() -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("docker is not installed: deploy/compose.yaml not checked by docker compose")
    probe = subprocess.run(
        [docker, "compose", "version"], check=False, capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0:
        pytest.skip(
            "docker compose is not installed (docker without the compose plugin): "
            "deploy/compose.yaml not checked by docker compose"
        )
    checked = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE), "config", "--quiet"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stderr


def _container_engine() -> str:
    """docker or podman, when one is installed and its engine answers; skips visibly
    otherwise (the documented absence of a container engine, not a pass)."""
    tried = []
    for name in ("docker", "podman"):
        found = shutil.which(name)
        if found is None:
            continue
        probe = subprocess.run(
            [found, "info"], check=False, capture_output=True, text=True, timeout=60
        )
        if probe.returncode == 0:
            return found
        tried.append(f"{name} is installed but `{name} info` failed: {probe.stderr.strip()[:200]}")
    pytest.skip(
        "no container engine answers ("
        + ("; ".join(tried) or "neither docker nor podman is installed")
        + "): the image is not built here; tox -e dist replays its install script"
    )


def _engine(engine: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [engine, *args], check=False, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.system
@pytest.mark.timeout(2400)
def test_the_image_builds_and_runs() -> None:
    engine = _container_engine()
    tag = f"waltz-test:{uuid.uuid4().hex[:12]}"
    built = _engine(
        engine, "build", "-f", str(DEPLOY / "container" / "Dockerfile"), "-t", tag, str(ROOT),
        timeout=1800,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    container = f"waltz-test-storage-{uuid.uuid4().hex[:8]}"
    try:
        listed = _engine(engine, "run", "--rm", tag, "plugins", "list")
        assert listed.returncode == 0, listed.stderr
        for plugin in ("fs", "zk", "etcd", "local", "zmq", "hwm-array"):
            assert re.search(rf"^  {plugin} +waltz-", listed.stdout, re.MULTILINE), listed.stdout
        # a storage node from the image's own config, as deploy/compose.yaml starts one
        started = _engine(
            engine, "run", "-d", "--name", container, tag,
            "storage", "--config", "/etc/waltz/storage.toml",
        )  # fmt: skip
        assert started.returncode == 0, started.stderr
        ready = (
            "import urllib.request as u; print(u.urlopen('http://127.0.0.1:9500/readyz').status)"
        )
        deadline = time.monotonic() + 180
        while True:
            probe = _engine(engine, "exec", container, "python", "-c", ready, timeout=60)
            if probe.returncode == 0 and probe.stdout.strip() == "200":
                break
            logs = _engine(engine, "logs", container)
            assert time.monotonic() < deadline, f"not ready: {logs.stdout}{logs.stderr}"
            time.sleep(1)
        stopped = _engine(engine, "stop", "--time", "30", container)
        assert stopped.returncode == 0, stopped.stderr
        code = _engine(engine, "inspect", "-f", "{{.State.ExitCode}}", container)
        assert code.stdout.strip() == "0", _engine(engine, "logs", container).stderr
    finally:
        _engine(engine, "rm", "-f", container)
        _engine(engine, "rmi", "-f", tag)


def test_the_dockerfile_runs_the_install_script_and_ignores_local_venvs() -> None:
    dockerfile = (DEPLOY / "container" / "Dockerfile").read_text(encoding="utf-8")
    script = (DEPLOY / "container" / "install-waltz.sh").read_text(encoding="utf-8")
    runs = re.findall(r"^RUN (.+(?:\\\n.+)*)", dockerfile, re.MULTILINE)
    # every pip step is the script's: nothing installed beside it
    assert not [r for r in runs if "pip" in r and "install-waltz.sh" not in r], runs
    assert any("install-waltz.sh wheels /wheels" in r for r in runs), runs
    assert any("install-waltz.sh install /wheels /opt/waltz" in r for r in runs), runs
    for package in (
        "waltz-cli",
        "waltz-storage-fs",
        "waltz-server",
        "waltz-storage-node",
        "waltz-coord-zk",
    ):
        assert f"./packages/{package} " in script, package
    ignored = (ROOT / ".dockerignore").read_text(encoding="utf-8").split()
    assert {".venv", ".tox", ".git"} <= set(ignored)
