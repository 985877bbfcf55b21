"""docs/operators.md's "A secured deployment", end to end on real processes: a ZooKeeper
with a TLS-only client port (client certificates required), the cluster's digest login
and ACLs on its znodes (or etcd with HTTPS, client certificates and a user whose role
covers the cluster's prefix); CurveZMQ keys made by ``waltz keys generate``; the cluster made
by ``waltz cluster create`` with the secured URI; a ``waltz storage`` node and a ``waltz
server`` configured as the guide's TOML shows (Curve on every listener, the server's
coordination options in its ``[coordination.options]`` table); an application with its
own key commits and reads back. Then what an attacker gets: another ZooKeeper identity
reads but cannot change the cluster's metadata, a plaintext client and a client with an
unknown key are refused at once with errors that say why, and each listener logs each
refused peer once however often it retries. Certificates are made by the test."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq.auth

from waltz_api.cluster import PARTITION_ASSIGNMENT_DIR, ClusterMetadata, coordination_from_uri
from waltz_api.config import toml_document
from waltz_api.errors import AuthenticationError, CoordinationError
from waltz_api.ports import free_port
from waltz_client import (
    AsyncWaltzClient,
    ClientConfig,
    Transaction,
)
from waltz_client.simple import MemoryMarks, Put
from waltz_conformance.servers.certs import TestPKI
from waltz_conformance.servers.etcd import EtcdAuth, EtcdCluster, EtcdTls
from waltz_conformance.servers.zookeeper import ZooKeeperServer, ZooKeeperTls
from waltz_server.server.testing import ServerProcess
from waltz_storage_node.testing import StorageNodeProcess
from waltz_transport_zmq import ZmqTransport

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]

PASSWORD = "a-long-random-password"
DEADLINE = 60.0
"""Seconds for a process to start, a partition to be assigned, a commit to be read back
(a loaded machine)."""
REFUSAL = 15.0
"""A refusal comes from the security handshake, far sooner than this; the connect
timeout given is twice as long, so a refusal that waited it out fails the test."""
RETRIES = 3


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPKI:
    return TestPKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def zookeeper(pki: TestPKI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperServer]:
    """Step 2: a TLS-only client port (no plaintext one), client certificates required."""
    tls = ZooKeeperTls(pki.issue("zookeeper", server=True), pki.issue("zk-health"))
    server = ZooKeeperServer(tmp_path_factory.mktemp("zk-tls"), tls=tls)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def etcd(pki: TestPKI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """etcd instead: HTTPS client URLs requiring client certificates, authentication on,
    the user's role limited to the cluster's prefix (and another user's to another)."""
    cluster = EtcdCluster(
        tmp_path_factory.mktemp("etcd-tls"),
        size=1,
        tls=EtcdTls(pki.issue("etcd", server=True), pki.issue("etcd-admin", common_name=False)),
        auth=EtcdAuth(
            "root-secret", {"waltz": (PASSWORD, ["/waltz/"]), "other": (PASSWORD, ["/other/"])}
        ),
    )
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@dataclass
class Secured:
    """A secured coordination service as the guide configures it: its URI with the
    given options, the options of the cluster's identity (step 3), and what another
    identity may not do."""

    kind: str
    uri: Callable[[dict[str, str] | None], str]
    security: dict[str, str]
    stranger: dict[str, str]


@pytest.fixture(params=["zk", "etcd"])
def secured(request: pytest.FixtureRequest, pki: TestPKI, tmp_path: Path) -> Secured:
    password_file = tmp_path / "coordination.password"
    password_file.write_text(PASSWORD + "\n")
    password_file.chmod(0o600)
    if request.param == "zk":
        zk: ZooKeeperServer = request.getfixturevalue("zookeeper")
        node = pki.issue("waltz-node")
        tls = {"tls_ca": str(node.ca), "tls_cert": str(node.cert), "tls_key": str(node.key)}
        return Secured(
            "zk",
            lambda options: zk.uri("/waltz", options),
            {**tls, "auth": "digest", "username": "waltz", "password_file": str(password_file)},
            tls,  # a valid client certificate, no login
        )
    cluster: EtcdCluster = request.getfixturevalue("etcd")
    node = pki.issue("waltz-etcd-node", common_name=False)
    tls = {"tls_ca": str(node.ca), "tls_cert": str(node.cert), "tls_key": str(node.key)}
    login = {"username": "waltz", "password_file": str(password_file)}
    return Secured(
        "etcd",
        lambda options: cluster.uri("/waltz", options),
        {**tls, **login},
        {**tls, **login, "username": "other"},  # a user whose role covers another prefix
    )


def waltz(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The ``waltz`` command, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "waltz_cli", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


class Marks(MemoryMarks):
    def __init__(self) -> None:
        super().__init__()
        self.applied: list[bytes] = []

    def apply_transaction(self, transaction: Transaction) -> None:
        super().apply_transaction(transaction)
        self.applied.append(transaction.get_data())


def log_lines(path: Path, says: str) -> list[str]:
    return [line for line in path.read_text().splitlines() if says in line]


async def logged(path: Path, says: str) -> list[str]:
    """The lines of ``path`` that say ``says``, once there is one (the log is written by
    another process); fails after DEADLINE."""
    deadline = time.monotonic() + DEADLINE
    while not (lines := log_lines(path, says)):
        assert time.monotonic() < deadline, f"{path.name} never said {says!r}"
        await asyncio.sleep(0.1)
    return lines


async def refused_fast(options: dict[str, Any], endpoint: str, says: str) -> None:
    """RETRIES connects with ``options`` to ``endpoint``: each refused with an
    AuthenticationError that says ``says``, well within the connect timeout."""
    transport = ZmqTransport(options)
    try:
        for _ in range(RETRIES):
            start = time.monotonic()
            with pytest.raises(AuthenticationError, match=says):
                await transport.connect(endpoint, timeout=2 * REFUSAL)
            took = time.monotonic() - start
            assert took < REFUSAL, f"the refusal took {took:.1f} s: it waited out the timeout"
    finally:
        await transport.close()


async def test_a_secured_deployment_end_to_end(secured: Secured, tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    keys = etc / "keys"
    etc.mkdir()
    # -- 1. certificates and the login's password file: the fixture's (made by the test)
    # -- transport keys: `waltz keys generate`, one pair per role and per application
    for name in ("storage", "server", "app1", "intruder"):
        made = waltz("keys", "generate", "--out", str(keys), "--name", name)
        assert made.returncode == 0, made.stderr
    authorized_servers, authorized_clients = etc / "authorized-servers", etc / "authorized-clients"
    authorized_servers.mkdir()
    authorized_clients.mkdir()
    (authorized_servers / "server.key").write_bytes((keys / "server.key").read_bytes())
    (authorized_clients / "app1.key").write_bytes((keys / "app1.key").read_bytes())
    # -- 3. the coordination URI, the same for every process (tls implied by tls_*)
    security = secured.security
    uri = secured.uri(security)
    storage_name = f"127.0.0.1:{free_port()}"
    created = waltz(
        "cluster", "create", "--partitions", "2", "--replicas", "1", "--storage", storage_name,
        env={"WALTZ_COORDINATION": uri},
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    assert PASSWORD not in created.stdout + created.stderr
    found = re.search(
        r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", created.stdout
    )
    assert found, f"no cluster key in: {created.stdout}"
    # -- 4. the storage node: Curve, only the servers' key authorized
    storage_config = {
        "log_level": "INFO",
        "storage": {
            "data_dir": str(tmp_path / "var" / "storage"),
            "cluster_key": found.group(0),
            "num_partitions": 2,
            "partitions": [0, 1],
        },
        "transport": {
            "endpoint": f"tcp://{storage_name}",
            "options": {
                "curve_server_key": str(keys / "storage.key_secret"),
                "curve_authorized_keys": str(authorized_servers),
            },
        },
    }
    # -- 5. the server: the URI without its query, the options in the table
    server_endpoint = f"tcp://127.0.0.1:{free_port()}"
    server_config = {
        "log_level": "INFO",
        "coordination": {
            "uri": secured.uri(None),
            "options": {**security, "session_timeout": 10},
        },
        "transport": {
            "endpoint": server_endpoint,
            "storage_endpoint": "tcp://{}",
            "options": {
                "curve_server_key": str(keys / "server.key_secret"),
                "curve_authorized_keys": str(authorized_clients),
                "curve_server_public_key": str(keys / "storage.key"),
                "curve_client_key": str(keys / "server.key_secret"),
            },
        },
    }
    (etc / "storage.toml").write_text(toml_document(storage_config))
    (etc / "server.toml").write_text(toml_document(server_config))
    storage_log, server_log = tmp_path / "storage.log", tmp_path / "server.log"
    storage = StorageNodeProcess(etc / "storage.toml", f"tcp://{storage_name}", storage_log)
    server = ServerProcess(etc / "server.toml", server_log)
    as_server = {
        "curve_server_public_key": str(keys / "storage.key"),
        "curve_client_key": str(keys / "server.key_secret"),
    }
    app1 = {
        "curve_server_public_key": str(keys / "server.key"),
        "curve_client_key": str(keys / "app1.key_secret"),
    }
    probe = ZmqTransport(as_server)
    watcher = coordination_from_uri(uri)
    try:
        storage.start()
        await storage.wait_ready(probe, timeout=DEADLINE)
        server.start()
        await server.wait_ready(timeout=DEADLINE)
        await watcher.start()
        metadata = ClusterMetadata(watcher)
        deadline = time.monotonic() + DEADLINE
        for partition in (0, 1):
            while (await metadata.partition_assignment(partition)).value.server_id < 0:
                assert time.monotonic() < deadline, f"partition {partition} never assigned"
                await asyncio.sleep(0.1)

        # -- an application with its own key commits, and its feed reads it back
        config = ClientConfig(
            uri,
            transport="zmq",
            transport_options=app1,
            partitions=[0],
            request_timeout=DEADLINE,
            transaction_timeout=DEADLINE,
        )
        marks = Marks()
        async with AsyncWaltzClient(marks, config) as client:
            committed = [
                (await client.submit(Put(b"secured %d" % i))).transaction_id for i in range(3)
            ]
            assert committed == sorted(committed) and len(set(committed)) == 3
            deadline = time.monotonic() + DEADLINE
            while marks.hwm.get(0, -1) < committed[-1]:
                assert time.monotonic() < deadline, "the feed never delivered the commits"
                await asyncio.sleep(0.05)
            assert marks.applied[-3:] == [b"secured 0", b"secured 1", b"secured 2"]

        # -- 6. check: the `waltz client` commands with the application's key
        with_key = [f"--transport-option={key}={value}" for key, value in app1.items()]
        env = {"WALTZ_COORDINATION": uri}
        appended = await asyncio.to_thread(
            waltz, "client", "append", *with_key, "--data", "from the cli", env=env
        )
        assert appended.returncode == 0, appended.stderr
        assert f"appended transaction {committed[-1] + 1} " in appended.stdout, appended.stdout
        mark = await asyncio.to_thread(
            waltz, "client", "high-water-mark", *with_key, "-o", "json", env=env
        )
        assert mark.returncode == 0 and str(committed[-1] + 1) in mark.stdout, mark.stderr

        # -- another identity of the coordination service: ZooKeeper's ACLs let it read
        # the cluster's state, not change it; etcd's roles refuse it the prefix at start
        path = f"{PARTITION_ASSIGNMENT_DIR}/0"
        before = await watcher.get(path)
        assert before is not None
        stranger = coordination_from_uri(secured.uri(secured.stranger))
        try:
            if secured.kind == "zk":
                await stranger.start()
                value = await stranger.get(path)
                assert value is not None and value.version == before.version
                with pytest.raises(CoordinationError, match="ACL does not allow"):
                    await stranger.set(path, b"hijacked", expected_version=value.version)
                with pytest.raises(CoordinationError, match="ACL does not allow"):
                    await stranger.delete(path)
            else:
                with pytest.raises(CoordinationError, match="permission denied"):
                    await asyncio.wait_for(stranger.start(), DEADLINE)
        finally:
            await stranger.close()
        still = await watcher.get(path)
        assert still is not None and still.version == before.version

        # -- a plaintext client and a client with an unknown key, at the server and at
        # the storage node: refused at once, saying why
        intruder = {**app1, "curve_client_key": str(keys / "intruder.key_secret")}
        await refused_fast({}, server_endpoint, "the listener requires CurveZMQ")
        await refused_fast(intruder, server_endpoint, "refused this transport's curve client")
        await refused_fast({}, f"tcp://{storage_name}", "the listener requires CurveZMQ")
        # the application's library too: a plaintext client's submission and request fail
        # at once with the refusal (its transaction timeout is far longer); so does the
        # `waltz client` command without the keys
        plain = ClientConfig(
            uri, transport="zmq", partitions=[0], request_timeout=2 * REFUSAL,
            transaction_timeout=2 * REFUSAL,
        )  # fmt: skip
        async with AsyncWaltzClient(Marks(), plain) as client:
            with pytest.raises(AuthenticationError, match="the listener requires CurveZMQ"):
                await asyncio.wait_for(client.submit(Put(b"from a plaintext client")), REFUSAL)
            with pytest.raises(AuthenticationError, match="the listener requires CurveZMQ"):
                await asyncio.wait_for(client.high_water_mark(0), REFUSAL)
        start = time.monotonic()
        refused = await asyncio.to_thread(
            waltz, "client", "append", "--data", "no keys", env={"WALTZ_COORDINATION": uri}
        )
        took = time.monotonic() - start
        assert refused.returncode != 0 and "the listener requires CurveZMQ" in refused.stderr, (
            refused.returncode,
            refused.stderr[-2000:],
        )
        assert took < 2 * REFUSAL, f"`waltz client append` took {took:.0f} s to give up"

        # -- each listener logged each refused peer once, however often it tried
        # (libzmq reports a refused plaintext peer as a mechanism mismatch, or without
        # detail when the peer hung up first: one line of each kind at most)
        plaintext = "this listener requires CurveZMQ"
        assert 1 <= len(await logged(server_log, plaintext)) <= 2
        unknown = await logged(server_log, "refused a CurveZMQ client at 127.0.0.1")
        assert len(unknown) == 1
        intruder_key, _ = zmq.auth.load_certificate(keys / "intruder.key")
        assert intruder_key.decode() in unknown[0]
        assert 1 <= len(await logged(storage_log, plaintext)) <= 2
        for log in (server_log, storage_log):
            assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
        assert PASSWORD not in server_log.read_text() + storage_log.read_text()
    finally:
        server.terminate()
        storage.terminate()
        await probe.close()
        await watcher.close()
