"""A cluster whose every process runs from a venv of its own choosing (`tox -e upgrade`).

:class:`MixedCluster` starts a real standalone ZooKeeper
(:mod:`waltz_conformance.servers.zookeeper`), writes the cluster metadata with a
version's own ``waltz cluster create``, and starts ``waltz storage`` nodes (``fs``
engine) and ``waltz server`` s from that version's ``bin/waltz``
(:class:`~waltz_storage_node.testing.StorageNodeProcess`,
:class:`~waltz_server.server.testing.ServerProcess`), and bank-workload clients, each
``python -m waltz_chaos.client`` from its version's venv: the simulation's workload
and envelope through the real ``waltz_client``, every op and every applied transaction
written to the client's SQLite database, which outlives its incarnations
(:mod:`waltz_chaos.client`). :meth:`MixedCluster.restart` stops one process by its
pid (SIGTERM: it drains), keeps its data, and starts it from another version.

While the versions are mixed the harness speaks no Waltz protocol itself (its own code
is the new version's): it waits on the processes' logs and on their HTTP endpoints
(``/readyz``, a storage node's ``/status``, the servers' ``/metrics``), and on the
clients' databases. At the end (:meth:`MixedCluster.finish`), with every process on
the new version, the clients drain and catch up, the cluster is read back
(:func:`waltz_chaos.collect.read_back`) and the histories go to the simulation's
checker (:func:`waltz_sim.checker.check`, one checker for every harness). Every
process is stopped by its pid in :meth:`MixedCluster.stop_all`, also after a failure.
Times are ``time.monotonic()`` (one clock for every process of the machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from waltz_api.config import toml_document
from waltz_api.contracts.transport import Transport
from waltz_api.errors import ProcessStartError
from waltz_api.plugins import get_registry
from waltz_api.ports import LOOPBACK, free_port
from waltz_api.supervised import SupervisedProcess
from waltz_chaos.client import DRAINED, READY, ClientSpec
from waltz_chaos.cluster import ClientProcess, ProcessEvent
from waltz_chaos.collect import ClientRecords, load_client, read_back
from waltz_conformance.servers.zookeeper import ZooKeeperServer
from waltz_server.server.testing import READY_MARKER as SERVER_READY
from waltz_server.server.testing import ServerProcess
from waltz_sim.checker import OK, CheckResult, History, LivenessBounds, check
from waltz_sim.workloads import op_mix
from waltz_storage_node.testing import READY_MARKER as STORAGE_READY
from waltz_storage_node.testing import StorageNodeProcess

log = logging.getLogger(__name__)

WORKLOAD = "bank"
HIGH_WATER_MARK = re.compile(
    r'^waltz_server_high_water_mark\{partition="(?P<partition>\d+)"\} (?P<value>\S+)$', re.MULTILINE
)


class HarnessError(AssertionError):
    """The cluster did not do what the run waited for, in time (with the logs to read)."""


@dataclass(frozen=True)
class Version:
    """A Waltz installed in a venv: its ``bin/waltz`` and ``bin/python`` run it."""

    label: str
    bin_dir: Path

    @property
    def waltz(self) -> list[str]:
        return [str(self.bin_dir / "waltz")]

    @property
    def python(self) -> str:
        return str(self.bin_dir / "python")


def this_venv(label: str | None = None) -> Version:
    """The venv running this process (the tox env's: the current code), labelled with
    its version (main carries the next development version: CONTRIBUTING.md)."""
    from importlib.metadata import version

    return Version(label or f"{version('waltz-api')} (this checkout)", Path(sys.executable).parent)


@dataclass
class Phase:
    name: str
    start: float
    end: float | None = None

    @property
    def seconds(self) -> float:
        return (self.end if self.end is not None else time.monotonic()) - self.start


@dataclass(eq=False)
class Member:
    """One process of the cluster and the version it runs now."""

    name: str
    kind: str
    """``storage``, ``server`` or ``client``."""
    version: Version
    handle: StorageNodeProcess | ServerProcess | ClientProcess
    http_port: int = 0
    data_dir: Path | None = None
    incarnation: int = 0
    versions: list[tuple[float, str]] = field(default_factory=list)
    """(when it started, the version's label), one per incarnation."""

    @property
    def child(self) -> SupervisedProcess:
        return self.handle.child

    @property
    def pid(self) -> int | None:
        return self.child.pid

    @property
    def running(self) -> bool:
        return self.child.running

    def this_run(self) -> str:
        """The log of the current incarnation."""
        return self.child.output()

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.this_run().splitlines()[-lines:])


async def until(
    check: Callable[[], Awaitable[bool]], timeout: float, what: Callable[[], str]
) -> None:
    """Until ``check()`` holds (polled), or a :class:`HarnessError` saying ``what()``."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise HarnessError(f"not within {timeout:.0f} s: {what()}")
        await asyncio.sleep(0.1)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return int(answer.status), answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def digest(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` (relative path -> SHA-256 of its bytes)."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def longest_gap(times: Iterable[float], start: float, end: float) -> tuple[float, float]:
    """The longest stretch of ``[start, end]`` without a time of ``times`` in it, and
    where it began: the longest wait for a commit during a window."""
    inside = sorted(t for t in times if start <= t <= end)
    edges = [start, *inside, end]
    gap, at = 0.0, start
    for before, after in itertools.pairwise(edges):
        if after - before > gap:
            gap, at = after - before, before
    return gap, at


@dataclass
class MixedCluster:
    """See the module docstring."""

    run_dir: Path
    initial: Version
    """Every storage node and server starts from it, and it writes the metadata."""
    client_versions: Sequence[Version]
    """One client per entry, started from that version."""
    storage_nodes: int = 3
    servers: int = 2
    partitions: int = 2
    session_timeout: float = 4.0
    ops_per_second: float = 4.0
    transaction_timeout: float = 15.0
    request_timeout: float = 10.0
    members: dict[str, Member] = field(default_factory=dict)
    events: list[ProcessEvent] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    cluster_key: uuid.UUID = field(default_factory=uuid.uuid4)
    uri: str = ""
    zookeeper: ZooKeeperServer | None = None
    transport: Transport | None = None

    # -- the parts ---------------------------------------------------------------------

    def of_kind(self, kind: str) -> list[Member]:
        return [m for m in self.members.values() if m.kind == kind]

    @property
    def coordination_options(self) -> dict[str, Any]:
        return {"session_timeout": self.session_timeout}

    @property
    def storage_endpoints(self) -> dict[str, str]:
        return {
            m.name: m.handle.endpoint
            for m in self.of_kind("storage")
            if isinstance(m.handle, StorageNodeProcess)
        }

    def phase(self, name: str) -> Phase:
        """A new phase (ended by the next one, or by :meth:`end_phase`)."""
        now = time.monotonic()
        self.end_phase(now)
        started = Phase(name, now)
        self.phases.append(started)
        log.info("phase: %s", name)
        return started

    def end_phase(self, now: float | None = None) -> None:
        if self.phases and self.phases[-1].end is None:
            self.phases[-1].end = time.monotonic() if now is None else now

    def diagnostics(self) -> str:
        """Every process's version and the end of its log (for a failure's message)."""
        parts = []
        for m in self.members.values():
            state = "running" if m.running else "stopped"
            parts.append(f"--- {m.name} ({m.version.label}, {state}):\n{m.tail()}")
        return "\n".join(parts)

    # -- start -------------------------------------------------------------------------

    async def start(self) -> None:
        for sub in ("logs", "config", "clients", "storage"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        zookeeper = ZooKeeperServer(self.run_dir / "zookeeper", tick_time_ms=250)
        self.zookeeper = zookeeper
        await asyncio.to_thread(zookeeper.start)
        self.uri = zookeeper.uri("/waltz")
        for i in range(self.storage_nodes):
            self._add_storage(f"storage-{i}")
        await self.waltz(
            self.initial,
            "cluster", "create", "--coordination", self.uri,
            "--partitions", str(self.partitions), "--replicas", str(self.storage_nodes),
            "--cluster-key", str(self.cluster_key),
            *[a for e in self.storage_endpoints.values() for a in ("--storage", e[6:])],
        )  # fmt: skip
        await asyncio.gather(*(self.start_member(m) for m in self.of_kind("storage")))
        for i in range(self.servers):
            self._add_server(f"server-{i}")
        await asyncio.gather(*(self.start_member(m) for m in self.of_kind("server")))
        for i, version in enumerate(self.client_versions):
            self._add_client(f"client-{i}", version)
        await asyncio.gather(*(self.start_member(m) for m in self.of_kind("client")))

    async def waltz(self, version: Version, *args: str, timeout: float = 60.0) -> str:
        """``waltz ARGS`` of ``version`` (its output; a :class:`HarnessError` on failure)."""
        argv = [*version.waltz, *args]
        try:
            done = await asyncio.to_thread(
                subprocess.run,
                argv,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise HarnessError(
                f"{version.label}: waltz {' '.join(args)}: no end in {timeout} s"
            ) from None
        if done.returncode != 0:
            raise HarnessError(
                f"{version.label}: waltz {' '.join(args)} exited {done.returncode}: "
                f"{done.stdout}{done.stderr}"
            )
        return done.stdout

    def _add_storage(self, name: str) -> None:
        port, http = free_port(LOOPBACK), free_port(LOOPBACK)
        config = {
            "log_level": "INFO",
            "storage": {
                "data_dir": str(self.run_dir / "storage" / name),
                "engine": "fs",
                "cluster_key": str(self.cluster_key),
                "num_partitions": self.partitions,
                "partitions": list(range(self.partitions)),
            },
            "transport": {"plugin": "zmq", "endpoint": f"tcp://{LOOPBACK}:{port}"},
            "http": {"enabled": True, "host": LOOPBACK, "port": http},
        }
        path = self.run_dir / "config" / f"{name}.toml"
        path.write_text(toml_document(config))
        handle = StorageNodeProcess(
            path,
            f"tcp://{LOOPBACK}:{port}",
            self.run_dir / "logs" / f"{name}.log",
            new_session=True,
            command=self.initial.waltz,
        )
        self.members[name] = Member(
            name, "storage", self.initial, handle, http, data_dir=self.run_dir / "storage" / name
        )

    def _add_server(self, name: str) -> None:
        http = free_port(LOOPBACK)
        config = {
            "log_level": "INFO",
            "coordination": {"uri": self.uri, "options": self.coordination_options},
            "transport": {
                "plugin": "zmq",
                "endpoint": f"tcp://{LOOPBACK}:{free_port(LOOPBACK)}",
                "storage_endpoint": "tcp://{}",
            },
            "http": {"enabled": True, "host": LOOPBACK, "port": http},
        }
        path = self.run_dir / "config" / f"{name}.toml"
        path.write_text(toml_document(config))
        handle = ServerProcess(
            path,
            self.run_dir / "logs" / f"{name}.log",
            new_session=True,
            command=self.initial.waltz,
        )
        self.members[name] = Member(name, "server", self.initial, handle, http)

    def _add_client(self, name: str, version: Version) -> None:
        spec = ClientSpec(
            name=name,
            workload=WORKLOAD,
            partitions=list(range(self.partitions)),
            coordination=self.uri,
            database=str(self.run_dir / "clients" / f"{name}.sqlite3"),
            coordination_options=self.coordination_options,
            ops_per_second=self.ops_per_second,
            transaction_timeout=self.transaction_timeout,
            request_timeout=self.request_timeout,
        )
        path = self.run_dir / "config" / f"{name}.json"
        spec.save(path)
        handle = ClientProcess(path, self.run_dir / "logs" / f"{name}.log", python=version.python)
        self.members[name] = Member(name, "client", version, handle)

    def client_spec(self, name: str) -> ClientSpec:
        return ClientSpec.load(self.run_dir / "config" / f"{name}.json")

    # -- a member's life -------------------------------------------------------------------

    async def start_member(self, member: Member, *, wait: bool = True) -> None:
        """Start ``member`` from its version; ``wait``: until it serves (a storage node
        answers a handshake, a server logged it is ready, a client is ready)."""
        member.incarnation += 1
        handle = member.handle
        handle.child.kill_at_exit = True  # should this run die without stopping it
        if isinstance(handle, ClientProcess):
            handle.python = member.version.python
            handle.start(member.incarnation)
        else:
            handle.command = member.version.waltz
            handle.start()
        now = time.monotonic()
        member.versions.append((now, member.version.label))
        self.events.append(ProcessEvent(now, member.name, "start", member.incarnation))
        if wait:
            await self.wait_serving(member)

    async def wait_serving(self, member: Member) -> None:
        """Until ``member`` serves: it logged its ready line, then its ``/readyz`` is 200
        (a server: every partition it serves recovered; a storage node: every hosted
        partition available and holding what its store session recovered)."""
        marker = {"storage": STORAGE_READY, "server": SERVER_READY, "client": READY}[member.kind]
        try:
            await member.child.wait_ready(re.escape(marker), timeout=60.0)
            if member.http_port:
                url = f"http://{LOOPBACK}:{member.http_port}/readyz"

                async def ready() -> bool:
                    code, _ = await asyncio.to_thread(_get, url)
                    return code == 200

                await member.child.wait_ready(
                    ready, timeout=90.0, interval=0.1, waiting_for=f"{url} to answer 200"
                )
        except ProcessStartError as exc:
            raise HarnessError(f"{member.name} ({member.version.label}): {exc}") from exc

    async def stop_member(self, member: Member, timeout: float = 60.0) -> int | None:
        """SIGTERM by pid until it exits (SIGKILL after ``timeout``): its exit code. A
        client drains (no new op; those in flight end) and catches up first."""
        if not member.running:
            return member.child.returncode
        code = await member.child.stop(timeout=timeout)
        if code == -signal.SIGKILL:
            self.events.append(
                ProcessEvent(time.monotonic(), member.name, "kill", member.incarnation)
            )
        return code

    async def restart(self, member: Member, version: Version) -> Phase:
        """One step of a rolling upgrade: ``member`` stopped by its pid (it must exit 0),
        its data kept, started from ``version``, until it serves."""
        phase = self.phase(f"{member.name}: {member.version.label} -> {version.label}")
        code = await self.stop_member(member)
        if code != 0:
            raise HarnessError(
                f"{member.name} ({member.version.label}) exited {code} on SIGTERM, not 0:\n"
                f"{member.tail()}"
            )
        member.version = version
        await self.start_member(member)
        return phase

    # -- what the run waits for ----------------------------------------------------------------

    async def high_water_marks(self) -> dict[int, int]:
        """Each partition's committed high-water mark, as the servers' ``/metrics`` say
        (``waltz_server_high_water_mark``; the highest any server reports: a former
        owner's gauge is never ahead)."""
        marks: dict[int, int] = {}
        for member in self.of_kind("server"):
            code, body = await asyncio.to_thread(
                _get, f"http://{LOOPBACK}:{member.http_port}/metrics"
            )
            if code != 200:
                continue
            for found in HIGH_WATER_MARK.finditer(body.decode(errors="replace")):
                partition, value = int(found["partition"]), int(float(found["value"]))
                marks[partition] = max(marks.get(partition, -1), value)
        return marks

    async def caught_up(self, member: Member, timeout: float = 90.0) -> None:
        """Until the storage node's ``/readyz`` is 200 and it holds, for every partition,
        at least the committed high-water mark read when this began (its ``/status``):
        what an operator watches (docs/operators.md, "Upgrading"), over HTTP, which
        every version serves alike."""
        url = f"http://{LOOPBACK}:{member.http_port}"
        targets: dict[int, int] = {}
        seen: dict[str, Any] = {}

        async def check() -> bool:
            if not member.running:
                raise HarnessError(f"{member.name} exited:\n{member.tail()}")
            if len(targets) < self.partitions:  # every partition served, its mark read
                targets.update(await self.high_water_marks())
                return False
            ready, _ = await asyncio.to_thread(_get, f"{url}/readyz")
            code, body = await asyncio.to_thread(_get, f"{url}/status")
            if ready != 200 or code != 200:
                return False
            status = json.loads(body)
            seen.update(status)
            held = {p["partition"]: p["max_transaction_id"] for p in status["partitions"]}
            return all(held.get(p, -1) >= t for p, t in targets.items())

        await until(
            check,
            timeout,
            lambda: f"{member.name} did not catch up to {targets}: {seen}\n{member.tail()}",
        )

    def committed_since(self, member: Member, since: float) -> int:
        """How many ops the client saw committed after ``since`` (its database)."""
        path = self.client_spec(member.name).database
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            row = db.execute(
                "SELECT COUNT(*) FROM ops WHERE kind = ? AND time > ?", (OK, since)
            ).fetchone()
        return int(row[0])

    async def commits(self, since: float, count: int = 3, timeout: float = 60.0) -> None:
        """Until every running client saw ``count`` ops committed after ``since``: the
        workload goes on with the cluster as it is now."""
        clients = [m for m in self.of_kind("client") if m.running]

        async def check() -> bool:
            return all(self.committed_since(m, since) >= count for m in clients)

        def what() -> str:
            counts = {m.name: self.committed_since(m, since) for m in clients}
            return f"commits per client since the step: {counts}\n{self.diagnostics()}"

        await until(check, timeout, what)

    # -- the end -----------------------------------------------------------------------------

    async def finish(self, bounds: LivenessBounds) -> tuple[CheckResult, dict[str, ClientRecords]]:
        """The clients stop submitting and drain (SIGUSR1), then catch up and exit
        (SIGTERM); the cluster is read back and the history checked."""
        clients = self.of_kind("client")
        submissions_end = time.monotonic()
        for member in clients:
            if member.running and member.pid is not None:
                os.kill(member.pid, signal.SIGUSR1)
        drain = self.transaction_timeout + self.request_timeout + 15.0
        await asyncio.gather(
            *(m.child.wait_ready(re.escape(DRAINED), timeout=drain) for m in clients)
        )
        end_time = time.monotonic()
        for member in clients:
            code = await self.stop_member(member, timeout=90.0)
            if code != 0:
                raise HarnessError(f"{member.name} exited {code}:\n{member.tail()}")
        self.transport = get_registry().get("transport", "zmq").factory({})
        back = await read_back(
            coordination=self.uri,
            coordination_options=self.coordination_options,
            transport_options={},
            transport=self.transport,
            partitions=list(range(self.partitions)),
            storage=self.storage_endpoints,
            cluster_key=self.cluster_key,
            num_partitions=self.partitions,
        )
        for note in back.notes:
            log.warning("read-back: %s", note)
        records = {
            m.name: load_client(m.name, Path(self.client_spec(m.name).database), self.events)
            for m in clients
        }
        history = History(
            ops=[op for r in records.values() for op in r.ops],
            feed=[e for r in records.values() for e in r.feed],
            clients=[c for r in records.values() for c in r.snapshots],
            start_time=self.phases[0].start if self.phases else 0.0,
            end_time=end_time,
            submissions_end=submissions_end,
            drained=True,
        )
        result = check(history, back.snapshot, op_mix(WORKLOAD).semantics, bounds)
        return result, records

    def stop_all(self) -> None:
        """Stop every process this cluster started, by its pid (also after a failure)."""
        for member in self.members.values():
            with contextlib.suppress(Exception):
                member.child.terminate(timeout=30.0)
        if self.zookeeper is not None:
            with contextlib.suppress(Exception):
                self.zookeeper.stop()
            self.zookeeper = None

    async def close(self) -> None:
        """The harness's own transport (the read-back's)."""
        if self.transport is not None:
            with contextlib.suppress(Exception):
                await self.transport.close()
            self.transport = None


def commit_times(records: dict[str, ClientRecords]) -> list[float]:
    """When each client learned of each of its commits."""
    return sorted(op.time for r in records.values() for op in r.ops if op.kind == OK)


__all__ = [
    "HarnessError",
    "Member",
    "MixedCluster",
    "Phase",
    "Version",
    "commit_times",
    "digest",
    "longest_gap",
    "this_venv",
    "until",
]
