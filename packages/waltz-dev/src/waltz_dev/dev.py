"""``waltz dev``: a whole Waltz cluster on one machine, on the embedded default.

Coordination: the ``local`` plugin (a SQLite file in the data directory).
Transport: ZeroMQ over loopback TCP. Storage: the ``fs`` engine in the data
directory. Three storage nodes (``waltz storage --config``) and one or more
servers (``waltz server --config``) run as child processes with config files
generated in the data directory; their logs go to ``DIR/logs/``.

The first start creates the cluster (the ``waltz cluster create`` logic) and
records its layout (cluster key, partitions, storage ports) in
``DIR/waltz-dev.json``; a later start on the same directory reuses the
cluster and its data. While it runs, ``DIR/waltz-dev.ready.json`` names the
endpoints and the coordination URI a client needs.

Children run in their own session (a Ctrl-C reaches the supervisor only, which
stops the servers first, then the storage nodes, each by its pid) and, on
Linux, receive SIGTERM should the supervisor die.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from waltz_api.cluster import coordination_from_uri
from waltz_api.errors import ConfigError, WaltzError
from waltz_api.ports import free_port
from waltz_api.supervised import ChildHandle, SupervisedProcess
from waltz_cli.devfile import READY_FILE, read_ready_file
from waltz_cli.devfile import alive as _alive
from waltz_server.cluster_admin import ClusterAdmin

log = logging.getLogger(__name__)

__all__ = ["READY_FILE", "DevCluster", "coordination_uri", "read_ready_file"]

STATE_FILE = "waltz-dev.json"
PID_FILE = "waltz-dev.pid"
COORDINATION_ROOT = "/waltz"
STORAGE_READY = "storage node ready on"
SERVER_READY = "ready on"
CONSOLE_READY = "console ready on"
CONSOLE_TOKEN_FILE = "console.token"
SESSION_TIMEOUT = 5.0
"""Seconds after which a crashed server's registration expires (local coordination)."""


def coordination_uri(data_dir: str | os.PathLike[str]) -> str:
    """The coordination URI of the dev cluster in ``data_dir``."""
    return f"local://{Path(data_dir).resolve() / 'coordination'}?root={COORDINATION_ROOT}"


def port_free(port: int) -> bool:
    """Whether a listener could bind ``port`` (connections of a previous run in TIME_WAIT
    do not count: ZeroMQ binds with SO_REUSEADDR too)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@dataclass
class DevState:
    """What a dev data directory keeps across restarts."""

    cluster_key: str
    partitions: int
    storage_ports: list[int]
    server_ports: list[int] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> DevState | None:
        if not path.exists():
            return None
        try:
            raw = json.loads(path.read_text())
            return cls(
                cluster_key=str(uuid.UUID(raw["cluster_key"])),
                partitions=int(raw["partitions"]),
                storage_ports=[int(p) for p in raw["storage_ports"]],
                server_ports=[int(p) for p in raw.get("server_ports", [])],
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"{path} is not a waltz dev state file ({exc}); use another --data-dir or "
                "delete that directory to start from scratch",
                key="data_dir",
            ) from None

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)


class Child(ChildHandle):
    """One child process (a storage node or a server), stopped by its pid: in its own
    session, SIGTERM should the supervisor die (a
    :class:`~waltz_api.supervised.SupervisedProcess`)."""

    def __init__(self, name: str, args: list[str], log_path: Path, ready_marker: str) -> None:
        self.name = name
        self.args = args
        self.log_path = log_path
        self.ready_marker = ready_marker
        self.child = SupervisedProcess(
            [sys.executable, "-m", "waltz_cli", *args],
            log_path,
            name=name,
            # the generated config is the whole truth: no WALTZ_* override of the user's
            # shell (e.g. WALTZ_COORDINATION, meant for the client commands) reaches it
            env={k: v for k, v in os.environ.items() if not k.startswith("WALTZ_")},
            new_session=True,
            die_with_parent=True,
        )

    def start(self) -> None:
        self.child.start()

    def output(self) -> str:
        """This run's part of the child's log."""
        return self.child.output()

    async def wait_ready(self, deadline: float) -> None:
        """Until this run logged its ready line, by the ``time.monotonic()`` deadline."""
        await self.child.wait_ready(re.escape(self.ready_marker), deadline=deadline)

    async def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL when it does not end in ``timeout`` seconds; the exit code."""
        return await self.child.stop(timeout)


class DevCluster:
    """A dev cluster in ``data_dir``: ``await start()``, ``await wait(stop)``, ``await stop()``."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        servers: int = 1,
        storage_nodes: int | None = None,
        partitions: int | None = None,
        session_timeout: float = SESSION_TIMEOUT,
        start_timeout: float = 90.0,
        metrics: bool = False,
        console: bool = False,
        archive: str = "",
    ) -> None:
        """``metrics``: every child serves /livez, /readyz and /metrics on a free
        loopback port (``metrics_urls``); ``console``: a ``waltz console`` child too
        (``console_url``; it implies ``metrics``, which it reads; its token is in
        ``DIR/console.token``)."""
        if servers < 1:
            raise ConfigError("--servers must be at least 1", key="servers")
        if storage_nodes is not None and storage_nodes < 1:
            raise ConfigError("--storage-nodes must be at least 1", key="storage_nodes")
        if partitions is not None and partitions < 1:
            raise ConfigError("--partitions must be at least 1", key="partitions")
        self.data_dir = Path(data_dir).resolve()
        self.num_servers = servers
        self._want_storage = storage_nodes
        self._want_partitions = partitions
        self.session_timeout = session_timeout
        self.start_timeout = start_timeout
        self.storage: list[Child] = []
        self.servers: list[Child] = []
        self.state: DevState | None = None
        self.created = False
        self._owns_pid_file = False
        self._hosted: list[list[int]] = []
        self.metrics = metrics or console
        self.archive = archive
        """The servers' archive URL (tiered storage), "" for none."""
        self.console: Child | None = None
        self.console_url: str | None = None
        self._want_console = console
        self.metrics_urls: dict[str, str] = {}
        """Child name -> its HTTP endpoint's base URL (with ``metrics``)."""

    @property
    def coordination_uri(self) -> str:
        return coordination_uri(self.data_dir)

    @property
    def storage_endpoints(self) -> list[str]:
        return (
            [] if self.state is None else [f"tcp://127.0.0.1:{p}" for p in self.state.storage_ports]
        )

    @property
    def server_endpoints(self) -> list[str]:
        return (
            [] if self.state is None else [f"tcp://127.0.0.1:{p}" for p in self.state.server_ports]
        )

    @property
    def children(self) -> list[Child]:
        return [*self.servers, *self.storage, *([self.console] if self.console else [])]

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self.children if c.pid is not None]

    def info(self) -> dict[str, Any]:
        """What a client (or a person) needs: the coordination URI and the endpoints."""
        return {
            "pid": os.getpid(),
            "data_dir": str(self.data_dir),
            "coordination": self.coordination_uri,
            "transport": "zmq",
            "cluster_key": None if self.state is None else self.state.cluster_key,
            "partitions": None if self.state is None else self.state.partitions,
            "servers": self.server_endpoints,
            "storage_nodes": self.storage_endpoints,
            "child_pids": self.pids,
            "metrics": dict(self.metrics_urls),
            "console": self.console_url,
            "console_token_file": str(self.data_dir / CONSOLE_TOKEN_FILE)
            if self.console_url
            else None,
            "logs": str(self.data_dir / "logs"),
            "created": self.created,
        }

    # -- start ---------------------------------------------------------------------------

    def _claim_directory(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        pid_path = self.data_dir / PID_FILE
        with contextlib.suppress(OSError, ValueError):
            other = int(pid_path.read_text().strip())
            if other != os.getpid() and _alive(other):
                raise ConfigError(
                    f"a waltz dev cluster (pid {other}) already runs in {self.data_dir}; stop it "
                    "(Ctrl-C) or use another --data-dir",
                    key="data_dir",
                )
        pid_path.write_text(f"{os.getpid()}\n")
        self._owns_pid_file = True

    def _load_state(self) -> DevState:
        path = self.data_dir / STATE_FILE
        state = DevState.load(path)
        if state is None:
            state = DevState(
                cluster_key=str(uuid.uuid4()),
                partitions=self._want_partitions or 1,
                storage_ports=[free_port() for _ in range(self._want_storage or 3)],
            )
        else:
            if self._want_partitions not in (None, state.partitions):
                raise ConfigError(
                    f"the dev cluster in {self.data_dir} has {state.partitions} partitions, not "
                    f"{self._want_partitions}; leave --partitions out or use another --data-dir",
                    key="partitions",
                )
            if self._want_storage not in (None, len(state.storage_ports)):
                raise ConfigError(
                    f"the dev cluster in {self.data_dir} has {len(state.storage_ports)} storage "
                    f"nodes, not {self._want_storage}; leave --storage-nodes out or use another "
                    "--data-dir",
                    key="storage_nodes",
                )
            for port in state.storage_ports:
                if not port_free(port):
                    raise ConfigError(
                        f"port {port} of a storage node of {self.data_dir} is in use (another "
                        "waltz dev on this directory, or another program); free it and retry",
                        key="data_dir",
                    )
        # Servers keep their ports when they are free (clients find them through the
        # coordination service anyway).
        ports = [p for p in state.server_ports if port_free(p)][: self.num_servers]
        while len(ports) < self.num_servers:
            port = free_port()
            if port not in ports and port not in state.storage_ports:
                ports.append(port)
        state.server_ports = ports
        state.save(path)
        return state

    async def _ensure_cluster(self, state: DevState) -> None:
        (self.data_dir / "coordination").mkdir(exist_ok=True)
        coordination = coordination_from_uri(self.coordination_uri)
        await coordination.start()
        try:
            metadata = ClusterAdmin(coordination)
            if await metadata.exists():
                config = await metadata.config()
                if str(config.cluster_key) != state.cluster_key:
                    raise ConfigError(
                        f"the coordination store in {self.data_dir} holds cluster "
                        f"{config.cluster_key}, but {STATE_FILE} names {state.cluster_key}; "
                        "use a fresh --data-dir",
                        key="data_dir",
                    )
            else:
                await metadata.create_cluster(
                    num_partitions=state.partitions,
                    num_replicas=min(3, len(state.storage_ports)),
                    storage_nodes=[f"127.0.0.1:{p}" for p in state.storage_ports],
                    cluster_key=uuid.UUID(state.cluster_key),
                )
                self.created = True
                log.info("created cluster %s in %s", state.cluster_key, self.data_dir)
            assignments = await metadata.replica_assignments()
            self._hosted = [
                list(assignments.partitions_of(f"127.0.0.1:{p}")) for p in state.storage_ports
            ]
        finally:
            await coordination.close()

    def _http_lines(self, name: str) -> list[str]:
        if not self.metrics:
            return []
        port = free_port()
        self.metrics_urls[name] = f"http://127.0.0.1:{port}"
        return ["[http]", "enabled = true", 'host = "127.0.0.1"', f"port = {port}"]

    def _storage_config(self, index: int, state: DevState) -> Path:
        path = self.data_dir / f"storage-{index}.toml"
        lines = [
            'log_level = "INFO"',
            "[storage]",
            f"data_dir = {json.dumps(str(self.data_dir / f'storage-{index}'))}",
            'engine = "fs"',
            f'cluster_key = "{state.cluster_key}"',
            f"num_partitions = {state.partitions}",
            f"partitions = {self._hosted[index]}",
            "[transport]",
            'plugin = "zmq"',
            f'endpoint = "tcp://127.0.0.1:{state.storage_ports[index]}"',
            *self._http_lines(f"storage node {index}"),
        ]
        path.write_text("\n".join(lines) + "\n")
        return path

    def _server_config(self, index: int, state: DevState) -> Path:
        path = self.data_dir / f"server-{index}.toml"
        lines = [
            'log_level = "INFO"',
            "[coordination]",
            f"uri = {json.dumps(self.coordination_uri)}",
            "[coordination.options]",
            f"session_timeout = {self.session_timeout}",
            "[transport]",
            'plugin = "zmq"',
            f'endpoint = "tcp://127.0.0.1:{state.server_ports[index]}"',
            'storage_endpoint = "tcp://{}"',
            "[server]",
            'lock_table = "hwm-array"',
            *([f"[server.archive]\nurl = {json.dumps(self.archive)}"] if self.archive else []),
            *self._http_lines(f"server {index}"),
        ]
        path.write_text("\n".join(lines) + "\n")
        return path

    async def start(self) -> None:
        """Create (first start) or reuse the cluster, start every child, wait until every
        partition is served. On failure everything started is stopped again."""
        self._claim_directory()
        try:
            state = self._load_state()
            self.state = state
            await self._ensure_cluster(state)
            logs = self.data_dir / "logs"
            self.storage = [
                Child(
                    f"storage node {i}",
                    ["storage", "--config", str(self._storage_config(i, state))],
                    logs / f"storage-{i}.log",
                    STORAGE_READY,
                )
                for i in range(len(state.storage_ports))
            ]
            self.servers = [
                Child(
                    f"server {i}",
                    ["server", "--config", str(self._server_config(i, state))],
                    logs / f"server-{i}.log",
                    SERVER_READY,
                )
                for i in range(self.num_servers)
            ]
            deadline = time.monotonic() + self.start_timeout
            for child in self.storage:
                child.start()
            for child in self.storage:
                await child.wait_ready(deadline)
            for child in self.servers:
                child.start()
            for child in self.servers:
                await child.wait_ready(deadline)
            await self._wait_assigned(deadline)
            if self._want_console:
                await self._start_console(logs, deadline)
            self._write_ready_file()
        except BaseException:
            await self.stop()
            raise

    async def _start_console(self, logs: Path, deadline: float) -> None:
        """``waltz console`` on a free loopback port, reading every child's endpoint."""
        port = free_port()
        http = [arg for url in self.metrics_urls.values() for arg in ("--http", url)]
        self.console = Child(
            "console",
            [
                "console",
                "--coordination",
                self.coordination_uri,
                "--listen",
                f"127.0.0.1:{port}",
                "--token-file",
                str(self.data_dir / CONSOLE_TOKEN_FILE),
                *http,
            ],
            logs / "console.log",
            CONSOLE_READY,
        )
        self.console.start()
        await self.console.wait_ready(deadline)
        self.console_url = f"http://127.0.0.1:{port}/"

    async def _wait_assigned(self, deadline: float) -> None:
        """Until every partition is assigned to a live server of this cluster."""
        coordination = coordination_from_uri(self.coordination_uri)
        await coordination.start()
        try:
            metadata = ClusterAdmin(coordination)
            while True:
                live = {s.server_id for s in await metadata.servers()}
                owners = [a.server_id for a in await metadata.partition_assignments()]
                if owners and all(o in live for o in owners):
                    return
                for child in self.servers:
                    if not child.running:
                        raise WaltzError(f"{child.name} exited; see {child.log_path}")
                if time.monotonic() > deadline:
                    raise WaltzError(
                        f"partitions not assigned after {self.start_timeout}s (owners {owners}, "
                        f"live servers {sorted(live)}); see the logs in {self.data_dir / 'logs'}"
                    )
                await asyncio.sleep(0.1)
        finally:
            await coordination.close()

    def _write_ready_file(self) -> None:
        path = self.data_dir / READY_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.info(), indent=2) + "\n")
        os.replace(tmp, path)

    # -- run and stop --------------------------------------------------------------------

    async def wait(self, stop: asyncio.Event) -> Child | None:
        """Until ``stop`` is set (None) or a child exits on its own (that child)."""
        while not stop.is_set():
            for child in self.children:
                if not child.running:
                    return child
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
        return None

    async def stop(self) -> None:
        """Stop the servers, then the storage nodes (by pid); remove the ready file."""
        if self._owns_pid_file:
            with contextlib.suppress(OSError):
                (self.data_dir / READY_FILE).unlink()
        if self.console is not None:
            await self.console.stop()
        await asyncio.gather(*(child.stop() for child in self.servers))
        await asyncio.gather(*(child.stop() for child in self.storage))
        if self._owns_pid_file:
            with contextlib.suppress(OSError):
                (self.data_dir / PID_FILE).unlink()
            self._owns_pid_file = False
