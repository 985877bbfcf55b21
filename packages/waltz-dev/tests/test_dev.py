"""``waltz dev`` as a user runs it: a subprocess, a real client against it, SIGINT, restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import waltz_api
from waltz_api.cluster import ClusterMetadata, coordination_from_uri
from waltz_api.features import MAX_FEATURE_LEVEL
from waltz_api.supervised import SupervisedProcess
from waltz_client import (
    JSON,
    AsyncWaltzClient,
    ClientConfig,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClientCallbacks,
)
from waltz_dev.dev import READY_FILE, DevCluster, read_ready_file
from waltz_server.observability import http_get

pytestmark = [pytest.mark.system, pytest.mark.timeout(120)]


class Recorder(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.hwm = -1
        self.values: list[str] = []

    async def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm

    async def apply_transaction(self, transaction: Transaction) -> None:
        self.values.append((await transaction.fetch_data(JSON))["v"])
        self.hwm = transaction.transaction_id


class Put(TransactionContext):
    def __init__(self, value: str) -> None:
        super().__init__()
        self.value = value

    def partition_id(self, num_partitions: int) -> int:
        return 0

    async def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_data({"v": self.value}, JSON)
        builder.write_lock("key", 1)
        return True


def run_waltz(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "waltz_cli", *args],
        cwd=cwd,
        env={k: v for k, v in os.environ.items() if k != "WALTZ_COORDINATION"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Dev:
    """``waltz dev`` as a child process (a SupervisedProcess)."""

    def __init__(
        self, data_dir: Path, log: Path, *args: str, env: dict[str, str] | None = None
    ) -> None:
        self.data_dir = data_dir
        self.log = log
        self.child = SupervisedProcess(
            [sys.executable, "-m", "waltz_cli", "dev", "--data-dir", str(data_dir), *args],
            log,
            name="waltz dev",
            env=None if env is None else {**os.environ, **env},
        )
        self.child.start()

    @property
    def process(self) -> subprocess.Popen[bytes]:
        assert self.child.process is not None
        return self.child.process

    async def ready(self, timeout: float = 60) -> dict[str, Any]:
        found: dict[str, Any] = {}

        def started() -> bool:
            info = read_ready_file(self.data_dir)
            if info is None or info["pid"] != self.process.pid:
                return False
            found.update(info)
            return True

        await self.child.wait_ready(started, timeout=timeout, interval=0.1)
        return found

    def interrupt(self) -> int | None:
        return self.child.terminate(timeout=60, signum=signal.SIGINT)

    def kill(self) -> None:
        self.child.kill()


async def append_and_read(uri: str, values: list[str]) -> list[str]:
    """Append ``values`` with a fresh client (feed from the start); all values of the log."""
    app = Recorder()
    async with AsyncWaltzClient(app, ClientConfig(uri, transport="zmq")) as client:
        for value in values:
            assert (await client.submit(Put(value))).committed
        top = await client.flush(0)
        assert top == app.hwm
    return app.values


async def test_dev_cluster_serves_a_client_stops_on_sigint_and_keeps_its_data(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "dev"
    log = tmp_path / "dev.log"
    dev = Dev(data_dir, log)
    children: list[int] = []
    try:
        info = await dev.ready()
        assert info["created"] is True
        assert len(info["storage_nodes"]) == 3 and len(info["servers"]) == 1
        children = info["child_pids"]
        # 3 storage nodes, a server and the console (its page answers)
        assert len(children) == 5 and all(alive(p) for p in children)
        assert info["console"].startswith("http://127.0.0.1:")
        page = await http_get(info["console"])
        assert page.status == 200 and "Waltz console" in page.body
        assert "  console:       " + info["console"] in log.read_text()
        first = await asyncio.wait_for(append_and_read(info["coordination"], ["a", "b", "c"]), 60)
        assert first == ["a", "b", "c"]

        assert dev.interrupt() == 0
        assert not [p for p in children if alive(p)], "children left running"
        assert not (data_dir / READY_FILE).exists()
        assert "waltz dev: stopped" in log.read_text()

        dev = Dev(data_dir, log)
        info = await dev.ready()
        assert info["created"] is False  # the same cluster, reused
        children = info["child_pids"]
        values = await asyncio.wait_for(append_and_read(info["coordination"], ["d"]), 60)
        assert values == ["a", "b", "c", "d"]  # the data survived the restart
        assert dev.interrupt() == 0
        assert not [p for p in children if alive(p)], "children left running"
    finally:
        dev.kill()
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


async def test_a_second_dev_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    data_dir = tmp_path / "dev"
    dev = Dev(
        data_dir,
        tmp_path / "dev.log",
        *("--partitions", "2", "--servers", "2", "--metrics", "--no-console"),
    )
    children: list[int] = []
    try:
        info = await dev.ready()
        children = info["child_pids"]
        assert info["partitions"] == 2 and len(info["servers"]) == 2
        assert info["console"] is None and len(children) == 5
        # --metrics: every process's endpoint, printed and in the ready file
        assert len(info["metrics"]) == 5
        printed = (tmp_path / "dev.log").read_text()
        for name, url in info["metrics"].items():
            assert f"{url}/metrics  ({name};" in printed
        second = await asyncio.to_thread(run_waltz, "dev", "--data-dir", str(data_dir))
        assert second.returncode == 1
        assert "already runs in" in second.stderr
        assert json.loads((data_dir / READY_FILE).read_text())["pid"] == dev.process.pid
        assert dev.interrupt() == 0
        # a restart with another partition count is refused with one clear line
        wrong = await asyncio.to_thread(
            run_waltz, "dev", "--data-dir", str(data_dir), "--partitions", "3"
        )
        assert wrong.returncode == 1
        assert "has 2 partitions, not 3" in wrong.stderr
        # a supervisor killed with SIGKILL takes its children with it (Linux), and the
        # directory starts again (its ports are free despite connections in TIME_WAIT)
        dev = Dev(data_dir, tmp_path / "dev.log")
        children = (await dev.ready())["child_pids"]
        dev.kill()
        deadline = time.monotonic() + 30
        while [p for p in children if alive(p)] and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        assert not [p for p in children if alive(p)], "children outlived a killed waltz dev"
        dev = Dev(data_dir, tmp_path / "dev.log")
        info = await dev.ready()
        children = info["child_pids"]
        assert info["created"] is False and info["partitions"] == 2
        assert dev.interrupt() == 0
    finally:
        dev.kill()
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(300)  # a dozen `waltz` processes: each pays an interpreter start
async def test_client_commands_append_tail_and_high_water_mark(tmp_path: Path) -> None:
    # a WALTZ_COORDINATION exported for the client commands does not reach the children
    # (a server would refuse it: it names a config section)
    env = {"WALTZ_COORDINATION": "zk://127.0.0.1:1/elsewhere"}
    dev = Dev(tmp_path / ".waltz-dev", tmp_path / "dev.log", "--partitions", "2", env=env)
    children: list[int] = []
    try:
        info = await dev.ready()
        children = info["child_pids"]
        uri = ["--coordination", info["coordination"]]

        async def waltz(*args: str) -> subprocess.CompletedProcess[str]:
            return await asyncio.to_thread(run_waltz, "client", *args)

        empty = await waltz("high-water-mark", *uri, "--partition", "1")
        assert (empty.returncode, empty.stdout) == (0, "-1\n"), empty.stderr
        appended = await waltz(
            "append", *uri, "--partition", "1", "--data", "hello", "--data", "wörld",
            "--header", "7", "--write-lock", "key:1",
        )  # fmt: skip
        assert appended.returncode == 0, appended.stderr
        assert appended.stdout.splitlines() == [
            "appended transaction 0 to partition 1",
            "appended transaction 1 to partition 1",
        ]
        hwm = await waltz("high-water-mark", *uri, "--partition", "1")
        assert hwm.stdout == "1\n"
        other = await waltz("high-water-mark", *uri, "--partition", "0")
        assert other.stdout == "-1\n"  # partitions are separate logs
        # without --coordination: the waltz dev running in ./.waltz-dev
        tail = await asyncio.to_thread(
            run_waltz, "client", "tail", "--partition", "1", cwd=tmp_path
        )
        assert tail.returncode == 0, tail.stderr
        assert tail.stdout.splitlines() == ["0\t7\thello", "1\t7\twörld"]
        part = await waltz("tail", *uri, "--partition", "1", "--from", "1", "--no-data")
        assert part.stdout.splitlines() == ["1\t7"]
        follow = subprocess.Popen(  # noqa: ASYNC220 - a child the test talks to
            [sys.executable, "-m", "waltz_cli", "client", "tail", *uri, "--partition",
             "1", "--from", "1", "--follow"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            more = await waltz("append", *uri, "--partition", "1", "--data", "late")
            assert more.returncode == 0, more.stderr
            assert follow.stdout is not None
            printed = []  # the follower prints what arrives (up to "late"), then Ctrl-C
            async with asyncio.timeout(60):
                while not printed or printed[-1] != "2\t0\tlate\n":
                    line = await asyncio.to_thread(follow.stdout.readline)
                    assert line, f"the follower ended early: {printed}"
                    printed.append(line)
            follow.send_signal(signal.SIGINT)
            rest, err = await asyncio.to_thread(follow.communicate, timeout=60)
            out = "".join(printed) + rest
        finally:
            if follow.poll() is None:
                follow.kill()
                follow.wait(timeout=30)
        assert follow.returncode == 0, err
        assert out.splitlines() == ["1\t7\twörld", "2\t0\tlate"]
        beyond = await waltz("tail", *uri, "--partition", "1", "--from", "5")
        assert beyond.returncode == 1 and "beyond the end of partition 1" in beyond.stderr
        missing = await waltz("high-water-mark", *uri, "--partition", "2")
        assert missing.returncode == 1 and "partition" in missing.stderr.splitlines()[-1]
        nowhere = await asyncio.to_thread(
            run_waltz, "client", "high-water-mark", cwd=tmp_path / ".waltz-dev"
        )
        assert nowhere.returncode == 1 and "give --coordination URI" in nowhere.stderr
        bad = await waltz("append", *uri, "--data", "x", "--read-lock", "nolockid")
        assert bad.returncode == 2 and "NAME:ID" in bad.stderr  # a usage error
        assert dev.interrupt() == 0
    finally:
        dev.kill()
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


async def _wait_ready(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, TimeoutError):
            if (await http_get(f"{url}/readyz", timeout=10)).status == 200:
                return
        assert time.monotonic() < deadline, f"{url}/readyz not 200 after {timeout}s"
        await asyncio.sleep(0.2)


async def _check_status(
    cluster: DevCluster, owner_id: int, owner_endpoint: str, generation: int
) -> None:
    """/status (JSON): the owner serves partition 0, writable, at the high-water mark of
    the two appends, every replica acknowledged them; each storage node reports its
    endpoint, disk and the partition's marks."""
    servers, nodes = [], []
    for name, url in cluster.metrics_urls.items():
        reply = await http_get(f"{url}/status")
        assert reply.status == 200 and reply.content_type == "application/json", (name, reply)
        (servers if name.startswith("server") else nodes).append(json.loads(reply.body))
    owner = next(s for s in servers if s["server_id"] == owner_id)
    assert owner["role"] == "server" and owner["endpoint"] == owner_endpoint
    for process in (*servers, *nodes):  # the version beside the levels
        assert process["version"] == waltz_api.__version__, process
        assert process["max_feature_level"] == MAX_FEATURE_LEVEL, process
    assert all(s["feature_level"] == MAX_FEATURE_LEVEL for s in servers)  # dev creates at max
    assert [s["leader"] for s in servers].count(True) == 1
    (partition,) = owner["partitions"]
    assert partition["partition"] == 0 and partition["generation"] == generation
    assert partition["state"] == "writable" and partition["high_water_mark"] == 1
    assert partition["session_id"] >= 0 and partition["appends"] >= 2
    assert sorted(partition["acknowledged"]) == sorted(partition["replicas"])
    assert all(mark == 1 for mark in partition["acknowledged"].values())
    assert sorted(n["endpoint"] for n in nodes) == sorted(cluster.storage_endpoints)
    for node in nodes:
        assert node["role"] == "storage" and node["serving"]
        assert node["disk"]["used"] > 0 and 0 < node["disk"]["free"] <= node["disk"]["size"]
        (hosted,) = node["partitions"]
        assert hosted["partition"] == 0 and hosted["max_transaction_id"] == 1


async def test_sigterm_drains_a_server_and_its_partition_moves_before_the_session_expires(
    tmp_path: Path,
) -> None:
    """`waltz dev --metrics`'s cluster (real processes): every process serves /readyz and
    /metrics; SIGTERM to the partition's server exits 0 and the other server commits
    the next append well before the server's coordination session (60 s) would expire."""
    session_timeout = 60.0
    cluster = DevCluster(
        tmp_path / "dev", servers=2, partitions=1, session_timeout=session_timeout, metrics=True
    )
    await cluster.start()
    try:
        assert len(cluster.metrics_urls) == 5
        assert cluster.info()["metrics"] == cluster.metrics_urls
        for url in cluster.metrics_urls.values():
            await _wait_ready(url)
            assert "waltz_build_info{" in (await http_get(f"{url}/metrics")).body
        uri = cluster.coordination_uri
        assert await asyncio.wait_for(append_and_read(uri, ["a", "b"]), 60) == ["a", "b"]
        coordination = coordination_from_uri(uri)
        await coordination.start()
        try:
            owner = (await ClusterMetadata(coordination).partition_assignment(0)).value
        finally:
            await coordination.close()
        await _check_status(cluster, owner.server_id, owner.endpoint, owner.generation)
        draining = cluster.servers[cluster.server_endpoints.index(owner.endpoint)]
        assert draining.process is not None
        started = time.monotonic()
        os.kill(draining.process.pid, signal.SIGTERM)
        assert await asyncio.to_thread(draining.process.wait, 30) == 0
        values = await asyncio.wait_for(append_and_read(uri, ["c"]), session_timeout / 2)
        moved_in = time.monotonic() - started
        assert values == ["a", "b", "c"]
        assert moved_in < session_timeout / 2
        assert "server shutting down" in draining.log_path.read_text()
    finally:
        await cluster.stop()


def test_dev_archive_gives_every_server_the_archive(tmp_path: Path) -> None:
    """`waltz dev --archive URL`: each server's config names the archive (a path with
    quotes and spaces stays one TOML string); without it there is no archive."""
    from waltz_dev.dev import DevState
    from waltz_server.server.config import load_server_config

    url = "file://" + str(tmp_path / "an archive" / 'with "quotes"')
    state = DevState(
        cluster_key="00000000-0000-0000-0000-000000000001",
        partitions=1,
        storage_ports=[1],
        server_ports=[2, 3],
    )
    archived = DevCluster(tmp_path / "a", servers=2, archive=url)
    archived.data_dir.mkdir()
    for index in range(2):
        config = load_server_config(archived._server_config(index, state), env={})
        assert config.server.archive.enabled and config.server.archive.url == url
    plain = DevCluster(tmp_path / "b")
    plain.data_dir.mkdir()
    assert not load_server_config(plain._server_config(0, state), env={}).server.archive.enabled
