"""Every ``waltz`` command that talks to a cluster ends within its ``--timeout``.

Each command runs against:

- a dead coordination service: a port nobody listens on (zk://, etcd://: refused, so
  reported at once), a port that accepts and never answers (a hung service: the
  timeout decides), and a ``local`` location that does not exist (refused, naming it,
  creating nothing);
- a ``waltz dev`` cluster (real server and storage node processes) whose server is
  stopped (SIGSTOP: it holds its port and answers nothing), then whose storage nodes
  are one killed (a closed port) and one stopped.

Where the timeout decides (a hung peer), each command is a real process (``python -m
waltz_cli``) and must end within --timeout plus :func:`margin` (the interpreter's start
on this machine, and closing). Where a refusal decides, every command runs in this
process (:func:`in_process`: no interpreter start per command, which cost more than
the commands themselves) and must leave no thread that would keep a process alive; one
command per kind of refusal also runs as a real process. Each ends with one ``error:``
line and the documented exit code: 4 when the cluster did not answer or refused, 1 for
a missing ``local`` location (no cluster there), 1 for ``cluster verify``'s problems.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from waltz_api.ports import free_port
from waltz_cli import load_all
from waltz_cli.deadline import DEFAULT_TIMEOUT, UNAVAILABLE_EXIT_CODE
from waltz_dev.dev import DevCluster
from waltz_server.cli import main as waltz_main

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]

TIMEOUT = 3.0
"""The --timeout the commands are given (each waits that long for a hung peer)."""
LONG = 30.0
"""The --timeout of commands that must end long before it (a refused connection): they
must end within half of it (a process's start is all they may take; how soon a refusal
is reported in the command itself is measured in-process, below)."""
CONCURRENCY = 3


@dataclass(frozen=True)
class Ran:
    args: tuple[str, ...]
    code: int | None
    stderr: str
    took: float

    def __str__(self) -> str:
        return (
            f"waltz {' '.join(self.args)}: exit {self.code} after {self.took:.1f}s: {self.stderr}"
        )


def waltz(*args: str, cwd: Path | None = None, limit: float = 120) -> Ran:
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "waltz_cli", *args],
            capture_output=True,
            text=True,
            timeout=limit,
            check=False,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            env={k: v for k, v in os.environ.items() if k != "WALTZ_COORDINATION"},
        )
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else str(exc.stderr)
        return Ran(args, None, stderr, time.monotonic() - started)
    return Ran(args, done.returncode, done.stderr, time.monotonic() - started)


def run_all(commands: list[list[str]], cwd: Path) -> list[Ran]:
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(lambda args: waltz(*args, cwd=cwd), commands))


def lingering(before: set[threading.Thread]) -> list[threading.Thread]:
    """Threads started since ``before`` that would keep a process from exiting."""
    return [t for t in threading.enumerate() if t not in before and not t.daemon]


def in_process(commands: list[list[str]], cwd: Path) -> list[Ran]:
    """Each command run in this process, one after the other (click's runner; the
    environment's WALTZ_COORDINATION removed, as for :func:`waltz`). A command that
    returned but left a thread that is not a daemon behind (a process would not exit)
    fails, unless the thread ends within 10 s."""
    results = []
    with contextlib.chdir(cwd):
        for args in commands:
            before = set(threading.enumerate())
            started = time.monotonic()
            result = CliRunner().invoke(waltz_main, args, env={"WALTZ_COORDINATION": None})
            took = time.monotonic() - started
            deadline = time.monotonic() + 10.0
            while lingering(before) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not lingering(before), f"waltz {' '.join(args)} left {lingering(before)}"
            assert not isinstance(result.exception, Exception), (args, result.exception)
            results.append(Ran(tuple(args), result.exit_code, result.stderr, took))
    return results


HEAVIEST_IMPORTS = "import waltz_server.cli, waltz_archive.tools"
"""What the slowest command to start imports (``archive verify``: pyarrow and numpy,
1-2 s on an idle machine, 3 s and more on a loaded one)."""


def startup() -> float:
    """The interpreter's start with the heaviest command's imports, measured now."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", HEAVIEST_IMPORTS], check=True, timeout=120)
    return time.monotonic() - started


def margin() -> float:
    """What a command may take past its --timeout: the interpreter's start and the
    heaviest command's imports as measured here now (a loaded machine starts slowly;
    measured again for each batch, as the load changes), times the runs at once, and
    6 s for closing and slack."""
    slowest = max(startup() for _ in range(2))
    return slowest * CONCURRENCY + 6.0


def timeout_bound(before: float, ran: list[Ran]) -> float:
    """The bound of commands that wait out ``TIMEOUT``: ``before`` (:func:`margin` plus
    ``TIMEOUT``, measured before the batch), or, when one took longer, the margin
    measured again after it, if larger (the machine's load grew during the batch: its
    processes started as slowly as one starts now)."""
    if all(r.took < before for r in ran):
        return before
    return max(before, margin() + TIMEOUT)


def one_line(ran: Ran) -> str:
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), str(ran)
    return lines[0]


# -- which commands talk to a cluster -----------------------------------------------------

SERVES = {"console", "dev", "chaos", "simulate", "spark"}
"""Top-level commands that run something rather than ask a cluster (a web console, a
dev cluster, a chaos run or a simulation, Spark jobs): their --timeout, if any, is
another thing."""


def cluster_commands() -> dict[str, click.Command]:
    """Every command with --coordination (or a storage node's --endpoint), by path."""
    found: dict[str, click.Command] = {}

    def walk(command: click.Command, path: str) -> None:
        if isinstance(command, click.Group):
            ctx = click.Context(command)
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                if sub is not None and not (path == "" and name in SERVES):
                    walk(sub, f"{path} {name}".strip())
            return
        names = {p.name for p in command.params}
        if "uri" in names or "endpoint" in names:
            found[path] = command

    walk(load_all(waltz_main), "")
    return found


def coordination_commands(uri: str, timeout: float = TIMEOUT) -> dict[str, list[str]]:
    """A valid invocation of each command that reaches the coordination service."""
    key = str(uuid.uuid4())
    c = ["--coordination", uri, "--timeout", str(timeout)]
    # fmt: off
    return {
        "acl check": ["acl", "check", *c, "--key", "k", "--partition", "0", "--permission", "read"],
        "acl disable": ["acl", "disable", *c],
        "acl enable": ["acl", "enable", *c],
        "acl grant": ["acl", "grant", *c, "--key", "k", "--partition", "0", "--permission", "read"],
        "acl list": ["acl", "list", *c],
        "acl revoke": ["acl", "revoke", *c, "--key", "k"],
        "archive restore": ["archive", "restore", *c, "--url", "file:///nowhere"],
        "archive status": ["archive", "status", *c],
        "archive verify": ["archive", "verify", *c],
        "client append": ["client", "append", *c, "--data", "x"],
        "client high-water-mark": ["client", "high-water-mark", *c],
        "client tail": ["client", "tail", *c],
        "cluster add-replica": ["cluster", "add-replica", "0", "127.0.0.1:1", *c],
        "cluster add-storage-node": ["cluster", "add-storage-node", "127.0.0.1:1", *c],
        "cluster create": ["cluster", "create", *c, "--partitions", "1", "--replicas", "1",
                           "--storage", "127.0.0.1:1"],
        "cluster delete": ["cluster", "delete", *c, "--cluster-key", key],
        "cluster features": ["cluster", "features", *c],
        "cluster remove-replica": ["cluster", "remove-replica", "0", "127.0.0.1:1", *c],
        "cluster remove-storage-node": ["cluster", "remove-storage-node", "127.0.0.1:1", *c],
        "cluster show": ["cluster", "show", *c],
        "cluster verify": ["cluster", "verify", *c],
        "perf consumers": ["perf", "consumers", *c, "-n", "5", "--no-progress"],
        "perf producers": ["perf", "producers", *c, "-n", "5", "--no-progress"],
        "server add-preferred-partition": ["server", "add-preferred-partition", *c,
                                           "--endpoint", "tcp://h:1", "--partition", "0"],
        "server list": ["server", "list", *c],
        "server list-preferred-partitions": ["server", "list-preferred-partitions", *c],
        "server remove-preferred-partition": ["server", "remove-preferred-partition", *c,
                                              "--endpoint", "tcp://h:1", "--partition", "0"],
        "server reset-preferred-partitions": ["server", "reset-preferred-partitions", *c,
                                              "--endpoint", "tcp://h:1"],
    }
    # fmt: on


def storage_commands(
    endpoint: str, cluster_key: str, out: Path, timeout: float = TIMEOUT
) -> dict[str, list[str]]:
    """A valid invocation of each command that reaches a storage node."""
    e = ["--endpoint", endpoint, "--timeout", str(timeout)]
    k = ["--cluster-key", cluster_key]
    return {
        "storage add-partition": ["storage", "add-partition", *e, *k, "7"],
        "storage availability": ["storage", "availability", *e, *k, "0", "available"],
        "storage list": ["storage", "list", *e],
        "storage max-transaction-id": ["storage", "max-transaction-id", *e, "0"],
        "storage remove-partition": ["storage", "remove-partition", *e, *k, "7", "--yes"],
        "storage scrub": ["storage", "scrub", *e],
        "storage snapshot": ["storage", "snapshot", *e, str(out / uuid.uuid4().hex)],
        "storage stats": ["storage", "stats", *e],
    }


def test_every_cluster_command_has_the_one_timeout_and_is_tested_here(tmp_path: Path) -> None:
    commands = cluster_commands()
    tested = set(coordination_commands("zk://h:1/w")) | set(
        storage_commands("tcp://h:1", "k", tmp_path)
    )
    assert set(commands) == tested, "a command that talks to a cluster is not tested here"
    for path, command in commands.items():
        timeouts = [p for p in command.params if p.name == "timeout"]
        assert timeouts, f"waltz {path} has no --timeout"
        assert timeouts[0].default == DEFAULT_TIMEOUT, f"waltz {path}: {timeouts[0].default}"


# -- a dead coordination service -------------------------------------------------------------


@pytest.fixture(scope="module")
def silent_port() -> Iterator[int]:
    """A port that accepts connections (the kernel completes them) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(512)
        yield listener.getsockname()[1]


@pytest.mark.parametrize("scheme", ["zk", "etcd"])
def test_a_refused_coordination_service_is_reported_at_once(scheme: str) -> None:
    """In this process (no interpreter start to measure): well within 1 s of the
    command's start, whatever its --timeout."""
    uri = f"{scheme}://127.0.0.1:{free_port()}/waltz"
    runner = CliRunner()
    for args in (["cluster", "show"], ["client", "high-water-mark"], ["acl", "list"]):
        runner.invoke(waltz_main, [*args, "--coordination", uri])  # imports, warmed up
        started = time.monotonic()
        result = runner.invoke(waltz_main, [*args, "--coordination", uri, "--timeout", "30"])
        took = time.monotonic() - started
        assert result.exit_code == UNAVAILABLE_EXIT_CODE, result.output
        assert "refused the connection" in result.output and uri in result.output
        assert took < 1.0, (args, took)


@pytest.mark.parametrize("how", ["refused", "silent"])
@pytest.mark.parametrize("scheme", ["zk", "etcd"])
def test_every_command_ends_within_its_timeout_against_a_dead_service(
    scheme: str, how: str, silent_port: int, tmp_path: Path
) -> None:
    """Refused: reported at once, far within a long --timeout (in this process, and
    ``cluster show`` as a process); silent: the timeout (processes)."""
    port = free_port() if how == "refused" else silent_port
    uri = f"{scheme}://127.0.0.1:{port}/waltz"
    commands = coordination_commands(uri, LONG if how == "refused" else TIMEOUT)
    bound = margin() + TIMEOUT if how == "silent" else LONG / 2
    if how == "refused":
        ran_all = [
            *in_process(list(commands.values()), tmp_path),
            waltz(*commands["cluster show"], cwd=tmp_path),
        ]
    else:
        ran_all = run_all(list(commands.values()), tmp_path)
        bound = timeout_bound(bound, ran_all)
    for ran in ran_all:
        line = one_line(ran)
        assert ran.code == UNAVAILABLE_EXIT_CODE, str(ran)
        assert ran.took < bound, f"{ran} (bound {bound:.1f}s)"
        if how == "refused":
            assert "refused the connection" in line, str(ran)
        else:
            assert f"within {TIMEOUT:g}" in line, str(ran)


def test_a_missing_local_location_is_refused_and_not_created(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "dir"
    uri = f"local://{missing}/coordination?root=/waltz"
    commands = coordination_commands(uri, LONG)
    creating = commands.pop("cluster create")
    bound = LONG / 2
    ran_all = [
        *in_process(list(commands.values()), tmp_path),
        waltz(*commands["cluster show"], cwd=tmp_path),
    ]
    for ran in ran_all:
        line = one_line(ran)
        assert ran.code == 1, str(ran)
        assert ran.took < bound, f"{ran} (bound {bound:.1f}s)"
        assert f"{missing}/coordination does not exist" in line, str(ran)
        assert "no Waltz cluster" in line, str(ran)
    assert not (tmp_path / "no").exists()
    # `cluster create` makes a new cluster there: the one command that may
    created = waltz(*creating, cwd=tmp_path)
    assert created.code == 0, str(created)
    assert (missing / "coordination" / "coordination.sqlite3").is_file()


# -- a cluster whose server, then storage nodes, are down -------------------------------------


@dataclass
class Dev:
    cluster: DevCluster
    uri: str
    key: str
    storage: list[str]


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dev]:
    cluster = DevCluster(tmp_path_factory.mktemp("deadlines") / "dev", partitions=2)
    try:
        asyncio.run(cluster.start())
        info = cluster.info()
        yield Dev(cluster, info["coordination"], info["cluster_key"], info["storage_nodes"])
    finally:
        for child in cluster.children:
            if child.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGCONT)
        asyncio.run(cluster.stop())


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_commands_end_within_their_timeout_while_the_server_is_stopped(
    dev: Dev, tmp_path: Path
) -> None:
    healthy = waltz("client", "append", "--coordination", dev.uri, "--data", "before")
    assert healthy.code == 0, str(healthy)
    c = ["--coordination", dev.uri, "--timeout", str(TIMEOUT)]
    commands = {
        "client append": (["client", "append", *c, "--data", "x"], UNAVAILABLE_EXIT_CODE),
        "client high-water-mark": (["client", "high-water-mark", *c], UNAVAILABLE_EXIT_CODE),
        "client tail": (["client", "tail", *c, "--partition", "1"], UNAVAILABLE_EXIT_CODE),
        "client tail --follow": (["client", "tail", *c, "--follow"], UNAVAILABLE_EXIT_CODE),
        "perf producers": (
            ["perf", "producers", *c, "-n", "5", "--no-progress"],
            UNAVAILABLE_EXIT_CODE,
        ),
        "perf consumers": (
            ["perf", "consumers", *c, "-n", "5", "--no-progress"],
            UNAVAILABLE_EXIT_CODE,
        ),
        "cluster show --replicas": (["cluster", "show", *c, "--replicas"], 0),
        "cluster verify": (["cluster", "verify", *c], 1),
    }
    (server,) = dev.cluster.servers
    assert server.pid is not None
    bound = margin() + TIMEOUT
    with stopped(server.pid):
        ran = run_all([args for args, _ in commands.values()], tmp_path)
    bound = timeout_bound(bound, ran)
    for (name, (_, code)), result in zip(commands.items(), ran, strict=True):
        assert result.code == code, f"{name}: {result}"
        assert result.took < bound, f"{name}: {result} (bound {bound:.1f}s)"
        if code == UNAVAILABLE_EXIT_CODE:
            one_line(result)


def test_storage_commands_end_within_their_timeout_when_a_node_is_down(
    dev: Dev, tmp_path: Path
) -> None:
    killed, hung = dev.cluster.storage[0], dev.cluster.storage[1]
    assert killed.pid is not None and hung.pid is not None
    os.kill(killed.pid, signal.SIGKILL)
    assert killed.process is not None
    killed.process.wait(timeout=30)  # its port closed
    node = dev.storage[0].removeprefix("tcp://")
    long = ["--coordination", dev.uri, "--timeout", str(LONG)]
    membership = {
        "cluster add-storage-node": ["cluster", "add-storage-node", node, *long],
        "cluster add-replica": ["cluster", "add-replica", "0", node, *long],
    }
    # a closed port: refused, at once (far within the long --timeout); in this process,
    # and `storage stats` as a process
    bound = LONG / 2
    commands = {**storage_commands(dev.storage[0], dev.key, tmp_path, LONG), **membership}
    ran = in_process(list(commands.values()), tmp_path)
    ran.append(waltz(*commands["storage stats"], cwd=tmp_path))
    for name, result in zip([*commands, "storage stats"], ran, strict=True):
        line = one_line(result)
        assert result.code == UNAVAILABLE_EXIT_CODE, f"{name}: {result}"
        assert "refused the connection" in line, f"{name}: {result}"
        assert result.took < bound, f"{name}: {result} (bound {bound:.1f}s)"
    # a hung node: the timeout
    c = ["--coordination", dev.uri, "--timeout", str(TIMEOUT)]
    bound = margin() + TIMEOUT
    commands = storage_commands(dev.storage[1], dev.key, tmp_path)
    hung_node = dev.storage[1].removeprefix("tcp://")
    commands["cluster add-replica"] = ["cluster", "add-replica", "1", hung_node, *c]
    commands["cluster show --replicas"] = ["cluster", "show", "--replicas", *c]
    commands["cluster verify"] = ["cluster", "verify", *c]
    with stopped(hung.pid):
        ran = run_all(list(commands.values()), tmp_path)
    bound = timeout_bound(bound, ran)
    for name, result in zip(commands, ran, strict=True):
        expected = {"cluster show --replicas": 0, "cluster verify": 1}.get(
            name, UNAVAILABLE_EXIT_CODE
        )
        assert result.code == expected, f"{name}: {result}"
        assert result.took < bound, f"{name}: {result} (bound {bound:.1f}s)"
        if expected == UNAVAILABLE_EXIT_CODE:
            one_line(result)
