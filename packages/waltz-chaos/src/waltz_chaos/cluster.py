"""The real cluster of a chaos run: its processes, where they run, and what is done to them.

:class:`Cluster` starts a coordination service (a standalone ZooKeeper, or a
one-member etcd: :mod:`waltz_conformance.servers`), writes the cluster metadata,
and starts ``waltz storage`` nodes on the ``fs`` engine, ``waltz server`` s and the
client processes (:mod:`waltz_chaos.client`) as child processes
(:class:`~waltz_storage_node.testing.StorageNodeProcess`,
:class:`~waltz_server.server.testing.ServerProcess`), each in its role's network
namespace when the run has them (``ip netns exec``), each in its own session (a
Ctrl-C reaches the chaos process only, which stops them by pid). Each storage node's
data directory is a small ``tmpfs`` mount of its own when the run may mount one
(root): a full disk is then a filler file taking every free byte.

A process that exits without the nemesis killing it is an *unexpected exit*: it is
recorded (with the end of its log) and restarted a second later, as a supervisor
would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from waltz_api.cluster import ClusterMetadata, coordination_from_uri
from waltz_api.config import toml_document
from waltz_api.contracts.transport import Transport
from waltz_api.errors import WaltzError
from waltz_api.plugins import get_registry
from waltz_api.ports import free_port
from waltz_api.supervised import ChildHandle, SupervisedProcess
from waltz_chaos.client import DRAINED, READY, ClientSpec
from waltz_chaos.errors import ChaosError
from waltz_chaos.external import ExternalProcess
from waltz_chaos.netns import NetworkLab
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.server.testing import ServerProcess
from waltz_storage_node.testing import StorageNodeProcess

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
STORAGE_PORT = 5500
SERVER_PORT = 5600
ZK_PORT = 2181
ETCD_PORTS = (2379, 2380)
FILLER = "chaos-disk-filler"
BROKEN_MARKER = "I/O error, closing it"
"""What the fs engine logs when it closes a partition after a write error."""


@dataclass
class ClusterSettings:
    """The cluster a run starts."""

    coordination: str = "zk"
    storage_nodes: int = 3
    servers: int = 2
    clients: int = 4
    workloads: tuple[str, ...] = ("bank", "register")
    partitions_per_workload: int = 2
    session_timeout: float = 4.0
    transaction_timeout: float = 15.0
    request_timeout: float = 10.0
    ops_per_second: float = 4.0
    max_inflight: int = 2
    disk_mb: int = 256
    seed: int = 0
    storage_options: dict[str, Any] = field(default_factory=dict)
    """The storage nodes' engine options (``[storage.options]``)."""

    @property
    def num_partitions(self) -> int:
        return self.partitions_per_workload * len(self.workloads)

    def workload_of(self, client: int) -> str:
        return self.workloads[client % len(self.workloads)]

    def partitions_of(self, workload: str) -> list[int]:
        base = self.workloads.index(workload) * self.partitions_per_workload
        return list(range(base, base + self.partitions_per_workload))


@dataclass
class ProcessEvent:
    """Something that happened to a process: a start, a kill, an unexpected exit."""

    time: float
    member: str
    what: str
    """``start``, ``kill``, ``pause``, ``resume``, ``exit`` (unexpected), ``restart``."""
    incarnation: int
    detail: str = ""


class ClientProcess(ChildHandle):
    """A ``python -m waltz_chaos.client`` child process (started and stopped by pid; a
    :class:`~waltz_api.supervised.SupervisedProcess`); ``python`` the interpreter (another
    venv's: that venv's client; this one's by default), which may change between starts."""

    def __init__(
        self, spec_path: Path, log_path: Path, wrap: Sequence[str] = (), python: str = ""
    ) -> None:
        self.spec_path = spec_path
        self.log_path = log_path
        self.wrap = list(wrap)
        self.python = python or sys.executable
        self.child = SupervisedProcess([], log_path, name="client", new_session=True)

    def start(self, incarnation: int) -> None:
        self.child.argv = [
            *self.wrap,
            self.python,
            "-m",
            "waltz_chaos.client",
            str(self.spec_path),
            str(incarnation),
        ]
        self.child.start()

    def output(self) -> str:
        """This incarnation's log."""
        return self.child.output()


@dataclass(eq=False)
class Member:
    """One process of the cluster (a storage node, a server or a client)."""

    name: str
    kind: str
    address: str
    port: int
    handle: StorageNodeProcess | ServerProcess | ClientProcess | ExternalProcess
    incarnation: int = 0
    down: bool = False
    """Killed by the nemesis (not restarted yet): not an unexpected exit."""
    paused: bool = False
    data_dir: Path | None = None
    mounted: bool = False

    @property
    def pid(self) -> int | None:
        return self.handle.pid

    @property
    def running(self) -> bool:
        return self.handle.running

    @property
    def external(self) -> bool:
        return isinstance(self.handle, ExternalProcess)

    def output(self) -> str:
        return self.handle.output()

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.output().splitlines()[-lines:])


@dataclass
class Cluster:
    """See the module docstring."""

    settings: ClusterSettings
    run_dir: Path
    lab: NetworkLab | None = None
    mount_disks: bool = False
    clock: Callable[[], float] = time.monotonic
    members: dict[str, Member] = field(default_factory=dict)
    events: list[ProcessEvent] = field(default_factory=list)
    cluster_key: uuid.UUID = field(default_factory=uuid.uuid4)
    coordination_uri: str = ""
    coordination_server: Any = None
    transport: Transport | None = None
    stopping: bool = False
    coordination_down: bool = False
    """Killed by the nemesis (not restarted yet): not an unexpected exit."""
    attached_partitions: int | None = None
    """The attached cluster's partitions (None: the run started its own cluster)."""
    attached_servers: int = 0
    """The attached cluster's registered servers."""
    extra_transport_options: dict[str, Any] = field(default_factory=dict)
    storage_endpoints: dict[str, str] = field(default_factory=dict)
    """Every storage node's endpoint (role -> endpoint), for the read-back."""
    _supervisor: asyncio.Task[None] | None = None
    _coordination_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    # -- addresses ----------------------------------------------------------------------

    def _address(self, role: str) -> str:
        return LOOPBACK if self.lab is None else self.lab.address(role)

    def _port(self, default: int) -> int:
        return free_port(LOOPBACK) if self.lab is None else default

    def _wrap(self, role: str) -> list[str]:
        return [] if self.lab is None else self.lab.wrap(role)

    @property
    def transport_options(self) -> dict[str, Any]:
        """Plaintext between the namespaces' addresses (a private network of the run);
        an attached cluster's options as given."""
        base = {} if self.lab is None else {"security": "plaintext"}
        return {**base, **self.extra_transport_options}

    @property
    def coordination_options(self) -> dict[str, Any]:
        return {"session_timeout": self.settings.session_timeout}

    def of_kind(self, kind: str) -> list[Member]:
        return [m for m in self.members.values() if m.kind == kind]

    def storage_name(self, member: Member) -> str:
        """The node's connect string in the cluster metadata (host:port)."""
        return f"{member.address}:{member.port}"

    # -- start ------------------------------------------------------------------------------

    async def start(self) -> None:
        settings = self.settings
        for sub in ("logs", "config", "clients", "storage"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self._start_coordination)
        self.transport = get_registry().get("transport", "zmq").factory(self.transport_options)
        for i in range(settings.storage_nodes):
            self._add_storage(f"storage-{i}")
        await self._create_metadata()
        await asyncio.gather(*(self.start_member(m) for m in self.of_kind("storage")))
        self.storage_endpoints = {
            m.name: f"tcp://{m.address}:{m.port}" for m in self.of_kind("storage")
        }
        for i in range(settings.servers):
            self._add_server(f"server-{i}")
        await asyncio.gather(*(self.start_member(m) for m in self.of_kind("server")))
        await self._wait_assigned()
        for i in range(settings.clients):
            self._add_client(f"client-{i}", settings.workload_of(i))
        await asyncio.gather(*(self.start_member(m) for m in self.of_kind("client")))
        await asyncio.gather(*(self.wait_client(m, READY) for m in self.of_kind("client")))
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    async def attach(
        self, uri: str, processes: dict[str, int], storage_endpoint: str = "tcp://{}"
    ) -> None:
        """Use the running cluster at ``uri`` instead of starting one: its processes named
        in ``processes`` (role -> pid) become members the nemesis may pause and kill;
        the clients start as usual. Its storage nodes are ``storage-0``... in the order of
        their names in the metadata. Refuses a cluster whose partitions the workloads
        need are not empty (the checker replays them from their first transaction)."""
        for sub in ("logs", "config", "clients"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        self.coordination_uri = uri
        self.transport = get_registry().get("transport", "zmq").factory(self.transport_options)
        coordination = coordination_from_uri(uri, self.coordination_options)
        await coordination.start()
        try:
            metadata = ClusterMetadata(coordination)
            config = await metadata.config()
            nodes = sorted((await metadata.replica_assignments()).storage)
            self.attached_servers = len(await metadata.servers())
        finally:
            await coordination.close()
        if config.num_partitions < self.settings.num_partitions:
            raise ChaosError(
                f"the cluster at {uri} has {config.num_partitions} partitions; the workloads "
                f"need {self.settings.num_partitions} (--partitions per workload x "
                f"{len(self.settings.workloads)} workloads)"
            )
        self.cluster_key = config.cluster_key
        self.attached_partitions = config.num_partitions
        await self._check_empty()
        for role, pid in sorted(processes.items()):
            kind = role.rpartition("-")[0]
            if kind not in ("storage", "server"):
                raise ChaosError(f"--process {role}={pid}: name it storage-N or server-N")
            handle = ExternalProcess(pid, self.run_dir / "logs" / f"{role}.log")
            self.members[role] = Member(role, kind, "", 0, handle, incarnation=1)
        for i in range(self.settings.clients):
            self._add_client(f"client-{i}", self.settings.workload_of(i))
        await asyncio.gather(*(self.start_member(m) for m in self.of_kind("client")))
        await asyncio.gather(*(self.wait_client(m, READY) for m in self.of_kind("client")))
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())
        self.storage_endpoints = {
            f"storage-{i}": storage_endpoint.format(node) for i, node in enumerate(nodes)
        }

    async def _check_empty(self) -> None:
        from waltz_client import AsyncWaltzClient, ClientConfig
        from waltz_sim.workloads import ReadOnlyCallbacks

        partitions = list(range(self.settings.num_partitions))
        client = AsyncWaltzClient(
            ReadOnlyCallbacks(),
            ClientConfig(
                coordination=self.coordination_uri,
                coordination_options=self.coordination_options,
                transport_options=self.transport_options,
                partitions=partitions,
            ),
        )
        await client.start()
        try:
            for partition in partitions:
                high = await client.high_water_mark(partition, timeout=30.0)
                if high >= 0:
                    raise ChaosError(
                        f"partition {partition} of the cluster at {self.coordination_uri} holds "
                        f"{high + 1} transactions: waltz chaos needs empty partitions (the "
                        "checker replays each from its first transaction); create a cluster "
                        "for it (waltz cluster create) or use another coordination root"
                    )
        finally:
            await client.close()

    def _start_coordination(self) -> None:
        address = self._address("coordination")
        workdir = self.run_dir / "coordination"
        workdir.mkdir(parents=True, exist_ok=True)
        if self.settings.coordination == "zk":
            from waltz_conformance.servers.zookeeper import ZooKeeperServer

            zk = ZooKeeperServer(
                workdir,
                port=None if self.lab is None else ZK_PORT,
                host=address,
                wrap=self._wrap("coordination"),
                tick_time_ms=250,
            )
            self.coordination_server = zk
            zk.start()
            self.coordination_uri = zk.uri("/waltz")
        elif self.settings.coordination == "etcd":
            from waltz_conformance.servers.etcd import EtcdCluster

            etcd = EtcdCluster(
                workdir,
                size=1,
                host=address,
                ports=None if self.lab is None else ETCD_PORTS,
                wrap=self._wrap("coordination"),
            )
            self.coordination_server = etcd
            etcd.start()
            self.coordination_uri = etcd.uri("/waltz")
        else:
            raise ChaosError(
                f"unknown coordination {self.settings.coordination!r}: choose zk or etcd"
            )
        self._event("coordination", "start", 1)

    async def _create_metadata(self) -> None:
        settings = self.settings
        coordination = coordination_from_uri(self.coordination_uri, self.coordination_options)
        await coordination.start()
        try:
            await ClusterAdmin(coordination).create_cluster(
                num_partitions=settings.num_partitions,
                num_replicas=settings.storage_nodes,
                storage_nodes=[self.storage_name(m) for m in self.of_kind("storage")],
                cluster_key=self.cluster_key,
            )
        finally:
            await coordination.close()

    async def _wait_assigned(self, timeout: float = 90.0) -> None:
        coordination = coordination_from_uri(self.coordination_uri, self.coordination_options)
        await coordination.start()
        try:
            metadata = ClusterMetadata(coordination)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                owners = [
                    (await metadata.partition_assignment(p)).value.server_id
                    for p in range(self.settings.num_partitions)
                ]
                if all(owner >= 0 for owner in owners):
                    return
                await asyncio.sleep(0.1)
        finally:
            await coordination.close()
        tails = "\n".join(f"{m.name}:\n{m.log_tail()}" for m in self.of_kind("server"))
        raise ChaosError(
            f"the partitions got no owner within {timeout:.0f} s; servers' logs:\n{tails}"
        )

    def _add_storage(self, name: str) -> None:
        address, port = self._address(name), self._port(STORAGE_PORT)
        data_dir = self.run_dir / "storage" / name
        data_dir.mkdir(parents=True, exist_ok=True)
        mounted = False
        if self.mount_disks:
            size = f"size={self.settings.disk_mb}m,mode=0755"
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", size, f"waltz-chaos-{name}", str(data_dir)],
                check=True,
                capture_output=True,
            )
            mounted = True
        config = {
            "log_level": "INFO",
            "storage": {
                "data_dir": str(data_dir / "data"),
                "engine": "fs",
                "cluster_key": str(self.cluster_key),
                "num_partitions": self.settings.num_partitions,
                "partitions": list(range(self.settings.num_partitions)),
                "options": dict(self.settings.storage_options),
            },
            "transport": {
                "plugin": "zmq",
                "endpoint": f"tcp://{address}:{port}",
                "options": self.transport_options,
            },
        }
        path = self.run_dir / "config" / f"{name}.toml"
        path.write_text(toml_document(config))
        handle = StorageNodeProcess(
            path,
            f"tcp://{address}:{port}",
            self.run_dir / "logs" / f"{name}.log",
            wrap=self._wrap(name),
            new_session=True,
        )
        self.members[name] = Member(
            name, "storage", address, port, handle, data_dir=data_dir, mounted=mounted
        )

    def _add_server(self, name: str) -> None:
        address, port = self._address(name), self._port(SERVER_PORT)
        config = {
            "log_level": "INFO",
            "coordination": {"uri": self.coordination_uri, "options": self.coordination_options},
            "transport": {
                "plugin": "zmq",
                "endpoint": f"tcp://{address}:{port}",
                "storage_endpoint": "tcp://{}",
                "options": self.transport_options,
            },
        }
        path = self.run_dir / "config" / f"{name}.toml"
        path.write_text(toml_document(config))
        handle = ServerProcess(
            path, self.run_dir / "logs" / f"{name}.log", wrap=self._wrap(name), new_session=True
        )
        self.members[name] = Member(name, "server", address, port, handle)

    def _add_client(self, name: str, workload: str) -> None:
        settings = self.settings
        spec = ClientSpec(
            name=name,
            workload=workload,
            partitions=settings.partitions_of(workload),
            coordination=self.coordination_uri,
            database=str(self.run_dir / "clients" / f"{name}.sqlite3"),
            seed=settings.seed,
            coordination_options=self.coordination_options,
            transport_options=self.transport_options,
            ops_per_second=settings.ops_per_second,
            max_inflight=settings.max_inflight,
            transaction_timeout=settings.transaction_timeout,
            request_timeout=settings.request_timeout,
        )
        path = self.run_dir / "config" / f"{name}.json"
        spec.save(path)
        handle = ClientProcess(path, self.run_dir / "logs" / f"{name}.log", self._wrap(name))
        self.members[name] = Member(name, "client", self._address(name), 0, handle)

    def client_spec(self, name: str) -> ClientSpec:
        return ClientSpec.load(self.run_dir / "config" / f"{name}.json")

    # -- a member's life ----------------------------------------------------------------------

    def _event(self, member: str, what: str, incarnation: int, detail: str = "") -> ProcessEvent:
        event = ProcessEvent(self.clock(), member, what, incarnation, detail)
        self.events.append(event)
        return event

    async def start_member(self, member: Member, *, wait: bool = True) -> None:
        member.incarnation += 1
        member.down = False
        member.paused = False
        handle = member.handle
        if isinstance(handle, ClientProcess):
            handle.start(member.incarnation)
        else:
            handle.start()
        self._event(member.name, "start", member.incarnation)
        if isinstance(handle, ExternalProcess):
            return
        if not wait:
            return
        if isinstance(handle, StorageNodeProcess):
            assert self.transport is not None
            await handle.wait_ready(self.transport, timeout=60.0)
        elif isinstance(handle, ServerProcess):
            await handle.wait_ready(timeout=60.0)

    async def wait_client(self, member: Member, marker: str, timeout: float = 60.0) -> bool:
        """Until the client's current incarnation logged ``marker`` (False: it did not in time)."""
        assert isinstance(member.handle, ClientProcess)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if marker in member.handle.output():
                return True
            if not member.running:
                return False
            await asyncio.sleep(0.1)
        return False

    def kill(self, member: Member) -> None:
        """kill -9 (and reap); the member stays down until :meth:`start_member`."""
        member.down = True
        member.handle.kill()
        member.paused = False
        self._event(member.name, "kill", member.incarnation)

    async def restart(self, member: Member) -> None:
        """A graceful restart (SIGTERM, SIGKILL after 10 s, start again)."""
        member.down = True
        handle = member.handle
        if isinstance(handle, ClientProcess | ExternalProcess):
            handle.kill()
        else:
            await asyncio.to_thread(handle.terminate, 10.0)
        self._event(member.name, "stop", member.incarnation)
        await self.start_member(member, wait=False)

    def pause(self, member: Member) -> None:
        if member.running and not member.paused:
            member.handle.pause()
            member.paused = True
            self._event(member.name, "pause", member.incarnation)

    def resume(self, member: Member) -> None:
        if member.paused:
            member.paused = False
            if member.running:
                member.handle.resume()
            self._event(member.name, "resume", member.incarnation)

    async def kill_coordination(self) -> None:
        """kill -9 the coordination service (after a start in progress has finished)."""
        async with self._coordination_lock:
            self.coordination_down = True
            server = self.coordination_server
            if self.settings.coordination == "zk":
                await asyncio.to_thread(server.kill)
            else:
                await asyncio.to_thread(server.kill_member, 0)
            self._event("coordination", "kill", 0)

    async def start_coordination(self) -> None:
        """Start it again on its data and wait until it serves (one start or kill at a
        time: its launcher is not meant for two threads)."""
        async with self._coordination_lock:
            server = self.coordination_server
            if self.settings.coordination == "zk":
                await asyncio.to_thread(server.start)
            else:
                await asyncio.to_thread(server.restart_member, 0)
            self.coordination_down = False
            self._event("coordination", "start", 0)

    @property
    def coordination_running(self) -> bool:
        server = self.coordination_server
        if server is None:
            return False
        if self.settings.coordination == "zk":
            return bool(server.running)
        return bool(server.members[0].running)

    # -- disks ----------------------------------------------------------------------------------

    def fill_disk(self, member: Member) -> int:
        """Take every free byte of the node's file system; returns how many."""
        assert member.data_dir is not None
        stats = os.statvfs(member.data_dir)
        free = stats.f_bavail * stats.f_frsize
        path = member.data_dir / FILLER
        # ENOSPC at the last block: it is full
        with path.open("wb") as f, contextlib.suppress(OSError):
            os.posix_fallocate(f.fileno(), 0, free)
        return free

    def free_disk(self, member: Member) -> None:
        assert member.data_dir is not None
        with contextlib.suppress(FileNotFoundError):
            (member.data_dir / FILLER).unlink()

    # -- supervision ------------------------------------------------------------------------------

    async def _supervise(self) -> None:
        """Restart a process that exited on its own (recorded as an unexpected exit)."""
        while not self.stopping:
            await asyncio.sleep(0.5)
            for member in list(self.members.values()):
                if self.stopping or member.down or member.running:
                    continue
                if not member.external and member.handle.process is None:
                    continue
                process = member.handle.process
                code = None if process is None else process.returncode
                self._event(
                    member.name,
                    "exit",
                    member.incarnation,
                    f"exit code {code}; its log ends with:\n{member.log_tail()}",
                )
                log.warning("%s exited on its own (exit code %s): restarting it", member.name, code)
                await asyncio.sleep(1.0)
                if not self.stopping and not member.down and not member.running:
                    with contextlib.suppress(WaltzError, OSError):
                        await self.start_member(member, wait=False)
            if (
                not self.stopping
                and self.coordination_server is not None
                and not self.coordination_running
                and not self.coordination_down
                and not self._coordination_lock.locked()
            ):
                self._event("coordination", "exit", 0, "the coordination service exited")
                try:
                    await self.start_coordination()
                except Exception as exc:
                    log.warning("restarting the coordination service failed: %s", exc)

    # -- the end ----------------------------------------------------------------------------------

    async def stop_clients(self, timeout: float) -> float:
        """SIGUSR1 (no new ops), until every client drained; returns when it was sent."""
        sent = self.clock()
        clients = self.of_kind("client")
        for member in clients:
            assert isinstance(member.handle, ClientProcess)
            member.handle.child.send_signal(signal.SIGUSR1)
        await asyncio.gather(*(self.wait_client(m, DRAINED, timeout) for m in clients))
        return sent

    async def finish_clients(self, timeout: float) -> None:
        """SIGTERM: each client catches up with the log and exits (killed after ``timeout``)."""
        self.stopping = True
        clients = self.of_kind("client")
        for member in clients:
            assert isinstance(member.handle, ClientProcess)
            member.handle.child.send_signal(signal.SIGTERM)
        for _ in range(int(timeout * 10)):
            if not any(m.running for m in clients):
                break
            await asyncio.sleep(0.1)
        for member in clients:
            if member.running:
                log.warning("%s did not finish within %.0f s: killed", member.name, timeout)
                self.kill(member)

    def stop_all(self) -> None:
        """Stop every process this cluster started, by pid (also after a failed start)."""
        self.stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()
        for member in self.members.values():
            handle = member.handle
            if member.paused:
                handle.resume()
            if isinstance(handle, ExternalProcess):
                continue  # the user's cluster: it stays up
            if isinstance(handle, ClientProcess):
                handle.kill()
            else:
                with contextlib.suppress(Exception):
                    handle.terminate(timeout=10.0)
        server = self.coordination_server
        if server is not None:
            with contextlib.suppress(Exception):
                server.stop()
            self.coordination_server = None

    def unmount(self, keep: Path | None = None) -> None:
        """Unmount the storage nodes' file systems (their data copied to ``keep`` first)."""
        for member in self.of_kind("storage"):
            if member.data_dir is None:
                continue
            if keep is not None and member.data_dir.exists():
                with contextlib.suppress(OSError, shutil.Error):
                    shutil.copytree(
                        member.data_dir,
                        keep / member.name,
                        ignore=shutil.ignore_patterns(FILLER),
                        dirs_exist_ok=True,
                    )
            if member.mounted:
                result = subprocess.run(
                    ["umount", str(member.data_dir)], capture_output=True, check=False
                )
                if result.returncode != 0:
                    subprocess.run(["umount", "-l", str(member.data_dir)], check=False)
                member.mounted = False


__all__ = ["Cluster", "ClusterSettings", "ExternalProcess", "Member", "ProcessEvent"]
