"""Waltz beside ZooKeeper and etcd: optimistic updates and plain appends, in one run.

Three systems, started here and measured in the same run, each as an application
uses it:

- **Waltz** through the client library (by default each worker, an asyncio task
  already, awaits ``AsyncWaltzClient.submit``: no task per transaction, the cheapest
  path for such workers; ``--waltz-api`` also measures ``submit_nowait``,
  ``submit_many`` (a process's K transactions as one batch, as an application that
  holds a queue of requests would) and the threaded ``WaltzClient``, one API's clients
  at a time, the peers beside the first): a
  ZooKeeper, three ``waltz storage`` nodes (fs engine, real fsync), one
  ``waltz server``, ZeroMQ on loopback, 4 partitions (``process_cluster.py``);
- **ZooKeeper** 3.8 standalone (fsync on, its default), through kazoo;
- **etcd** 3.4, three members (each fsyncs its WAL), through its v3 JSON gateway
  (aiohttp), started as the conformance harness starts them.

Workloads, 100-byte values over ``--entities`` entities (1000):

- **occ**: one optimistic update of a random entity. Waltz: one transaction with a
  WRITE lock on the entity, built on the client's high-water mark (the client
  re-executes it after a lock failure). ZooKeeper: ``get`` the znode's version, then
  ``set`` with that version (again from the read on BadVersion). etcd: ``range`` for
  the key's mod_revision, then a ``txn`` putting it if the revision is unchanged
  (again from the read when it changed).
- **append**: one write that conflicts with nothing. Waltz: a transaction without
  locks (partitions in turn); ZooKeeper: a sequential znode; etcd: a put of a new key.

K concurrent workers (K = 1, 8, 32, 64) run each workload for ``--seconds`` per
system. Workers live in ``min(K, --processes)`` worker processes with one client
each, shared by the process's workers as an application's threads share one (Waltz
and etcd workers are asyncio tasks, ZooKeeper workers threads: kazoo is threaded).
A Waltz client consumes the feed of all 4 partitions, as an application does.

Printed: commits/s and p50/p99 latency of each cell, the ratios Waltz/ZooKeeper and
Waltz/etcd, the goals of issue 16 beside the figures (occ at K=64 at least 5x both
peers; at K=1 at least etcd), the Waltz server's RSS and CPU microseconds per commit.
Figures only, never pass/fail. Needs the Debian packages zookeeper and etcd-server.

    .venv/bin/python bench/peers.py [--seconds 5] [--ks 1,8,32,64] [--processes 4]
        [--systems waltz,zookeeper,etcd] [--waltz-api nowait,submit,many,threads,...]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import multiprocessing
import multiprocessing.connection
import random
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from process_cluster import peak_rss_mb, process_cluster
from profiling import CpuMeter, Spy

SYSTEMS = ("waltz", "zookeeper", "etcd")
LABELS = {"waltz": "Waltz", "zookeeper": "ZooKeeper", "etcd": "etcd"}
WORKLOADS = ("occ", "append")
PARTITIONS = 4
VALUE = bytes(range(100))
ZK_ROOT = "/peers"
ETCD_PREFIX = "/peers"

Command = dict[str, Any]
Result = dict[str, Any]


# -- worker processes ----------------------------------------------------------------------


@dataclass
class Tally:
    """What one worker process's workers did in a cell."""

    commits: int = 0
    attempts: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)
    lead: bool = False
    """A worker took the process's batch (``--waltz-api many``)."""

    def result(self, cpu: float) -> Result:
        return {
            "commits": self.commits,
            "attempts": self.attempts,
            "errors": self.errors,
            "latencies": self.latencies,
            "cpu": cpu,
        }


def _wait_start(command: Command) -> float:
    """Sleep until the cell's common start; its end on this process's perf_counter."""
    time.sleep(max(0.0, command["start"] - time.time()))
    return time.perf_counter() + float(command["seconds"])


def worker_main(
    system: str,
    address: str,
    index: int,
    pipe: multiprocessing.connection.Connection,
    api: str = "submit",
) -> None:
    """A worker process: one client of ``system``, then cells until told to stop."""
    logging.basicConfig(level=logging.WARNING)
    if system == "waltz" and api.startswith("threads"):
        _waltz_thread_worker(address, pipe, api)
    elif system == "waltz":
        asyncio.run(_waltz_worker(address, pipe, api))
    elif system == "zookeeper":
        _zookeeper_worker(address, pipe)
    else:
        asyncio.run(_etcd_worker(address.split(","), index, pipe))


async def _serve_cells(
    pipe: multiprocessing.connection.Connection,
    run: Callable[[Command, float, Tally], Coroutine[Any, Any, None]],
) -> None:
    """The asyncio workers' command loop: ``run(command, end, tally)`` is one worker."""
    loop = asyncio.get_running_loop()
    pipe.send({"ready": True})
    while True:
        command: Command = await loop.run_in_executor(None, pipe.recv)
        if command.get("stop"):
            return
        await asyncio.sleep(max(0.0, command["start"] - time.time()))
        end = time.perf_counter() + command["seconds"]
        tally = Tally()
        cpu = time.process_time()
        await asyncio.gather(*(run(command, end, tally) for _ in range(command["tasks"])))
        pipe.send(tally.result(time.process_time() - cpu))


WALTZ_APIS = ("submit", "nowait", "many", "threads", "threads-nowait")
"""How the Waltz workers submit: ``submit`` (a task each, ``await client.submit``),
``nowait`` (``await client.submit_nowait``: a future each, one task per loop turn's
submissions), ``many`` (one ``submit_many`` of the process's K workers' transactions at a
time), ``threads`` (the synchronous ``WaltzClient`` from K threads, ``submit().result()``),
``threads-nowait`` (the same with ``submit_nowait().result()``)."""


def _waltz_contexts(asynchronous: bool) -> tuple[type, type, type]:
    """The application's callbacks and contexts (async methods, or plain for threads)."""
    from waltz_client import (
        Transaction,
        TransactionBuilder,
        TransactionContext,
        WaltzClientCallbacks,
    )

    class Applied(WaltzClientCallbacks):
        """The application's state: only how far it applied each partition."""

        def __init__(self) -> None:
            self.marks: dict[int, int] = {}

        def client_high_water_mark(self, partition_id: int) -> int:
            return self.marks.get(partition_id, -1)

        def apply_transaction(self, transaction: Transaction) -> None:
            self.marks[transaction.partition_id] = transaction.transaction_id

    class AsyncApplied(Applied):
        async def client_high_water_mark(self, partition_id: int) -> int:  # type: ignore[override]
            return self.marks.get(partition_id, -1)

        async def apply_transaction(self, transaction: Transaction) -> None:  # type: ignore[override]
            self.marks[transaction.partition_id] = transaction.transaction_id

    class Update(TransactionContext):
        def __init__(self, entity: int) -> None:
            super().__init__()
            self.entity = entity

        def partition_id(self, num_partitions: int) -> int:
            return self.entity % num_partitions

        def execute(self, builder: TransactionBuilder) -> bool:
            builder.set_data(VALUE)
            builder.write_lock("entity", self.entity)
            return True

    class Append(TransactionContext):
        def __init__(self, partition: int) -> None:
            super().__init__()
            self.partition = partition

        def partition_id(self, num_partitions: int) -> int:
            return self.partition % num_partitions

        def execute(self, builder: TransactionBuilder) -> bool:
            builder.set_data(VALUE)
            return True

    class AsyncUpdate(Update):
        async def execute(self, builder: TransactionBuilder) -> bool:  # type: ignore[override]
            builder.set_data(VALUE)
            builder.write_lock("entity", self.entity)
            return True

    class AsyncAppend(Append):
        async def execute(self, builder: TransactionBuilder) -> bool:  # type: ignore[override]
            builder.set_data(VALUE)
            return True

    if asynchronous:
        return AsyncApplied, AsyncUpdate, AsyncAppend
    return Applied, Update, Append


async def _waltz_worker(uri: str, pipe: multiprocessing.connection.Connection, api: str) -> None:
    from waltz_client import AsyncWaltzClient, ClientConfig

    applied, update, append = _waltz_contexts(asynchronous=True)
    rng = random.Random()
    turn = iter(range(1 << 62))
    config = ClientConfig(uri, transport="zmq")
    async with AsyncWaltzClient(applied(), config) as client:
        for partition in range(PARTITIONS):  # mounted: every partition's feed is caught up
            await client.flush(partition)

        def make(command: Command) -> Any:
            if command["workload"] == "occ":
                return update(rng.randrange(command["entities"]))
            return append(next(turn))

        def count(tally: Tally, result: Any, started: float, done: float, end: float) -> None:
            if isinstance(result, BaseException):
                tally.errors += 1
            elif result and done <= end:
                tally.commits += 1
                tally.attempts += result.attempts
                tally.latencies.append(done - started)

        async def worker(command: Command, end: float, tally: Tally) -> None:
            if api == "many":
                if tally.lead:
                    return  # one batch of all this process's workers at a time
                tally.lead = True
                while (started := time.perf_counter()) < end:
                    results = await client.submit_many(
                        [make(command) for _ in range(command["tasks"])]
                    )
                    done = time.perf_counter()
                    for result in results:
                        count(tally, result, started, done, end)
                return
            submit = client.submit_nowait if api == "nowait" else client.submit
            while (started := time.perf_counter()) < end:
                try:
                    result = await submit(make(command))
                except Exception as exc:
                    result = exc
                count(tally, result, started, time.perf_counter(), end)

        await _serve_cells(pipe, worker)


def _waltz_thread_worker(uri: str, pipe: multiprocessing.connection.Connection, api: str) -> None:
    """The synchronous WaltzClient, one per process, shared by K threads."""
    from waltz_client import ClientConfig, WaltzClient

    applied, update, append = _waltz_contexts(asynchronous=False)
    with WaltzClient(applied(), ClientConfig(uri, transport="zmq")) as client:
        for partition in range(PARTITIONS):
            client.flush(partition)
        submit = client.submit_nowait if api == "threads-nowait" else client.submit
        turn = iter(range(1 << 62))
        pipe.send({"ready": True})
        while True:
            command: Command = pipe.recv()
            if command.get("stop"):
                return
            tally = Tally()
            lock = threading.Lock()

            def worker(
                command: Command = command, tally: Tally = tally, lock: threading.Lock = lock
            ) -> None:
                rng = random.Random()
                occ = command["workload"] == "occ"
                end = _wait_start(command)
                while (started := time.perf_counter()) < end:
                    with lock:
                        context = (
                            update(rng.randrange(command["entities"]))
                            if occ
                            else append(next(turn))
                        )
                    try:
                        result = submit(context).result()
                    except Exception:
                        with lock:
                            tally.errors += 1
                        continue
                    done = time.perf_counter()
                    if result and done <= end:
                        with lock:
                            tally.commits += 1
                            tally.attempts += result.attempts
                            tally.latencies.append(done - started)

            cpu = time.process_time()
            threads = [threading.Thread(target=worker) for _ in range(command["tasks"])]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            pipe.send(tally.result(time.process_time() - cpu))


def _zookeeper_worker(hosts: str, pipe: multiprocessing.connection.Connection) -> None:
    from kazoo.client import KazooClient
    from kazoo.exceptions import BadVersionError

    zk = KazooClient(hosts=hosts, timeout=30.0)
    zk.start(timeout=60)
    pipe.send({"ready": True})
    try:
        while True:
            command: Command = pipe.recv()
            if command.get("stop"):
                return
            tally = Tally()
            lock = threading.Lock()
            occ = command["workload"] == "occ"
            entities = command["entities"]

            def worker(
                command: Command = command,
                tally: Tally = tally,
                occ: bool = occ,
                entities: int = entities,
                lock: threading.Lock = lock,
            ) -> None:
                rng = random.Random()
                end = _wait_start(command)
                while (started := time.perf_counter()) < end:
                    attempts = 1
                    try:
                        if occ:
                            path = f"{ZK_ROOT}/e{rng.randrange(entities)}"
                            while True:
                                _, stat = zk.get(path)
                                try:
                                    zk.set(path, VALUE, version=stat.version)
                                    break
                                except BadVersionError:
                                    attempts += 1
                        else:
                            zk.create(f"{ZK_ROOT}/log/x-", VALUE, sequence=True)
                    except Exception:
                        with lock:
                            tally.errors += 1
                        continue
                    done = time.perf_counter()
                    if done <= end:
                        with lock:
                            tally.commits += 1
                            tally.attempts += attempts
                            tally.latencies.append(done - started)

            cpu = time.process_time()
            threads = [threading.Thread(target=worker) for _ in range(command["tasks"])]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            pipe.send(tally.result(time.process_time() - cpu))
    finally:
        zk.stop()
        zk.close()


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")


async def _etcd_worker(
    endpoints: list[str], index: int, pipe: multiprocessing.connection.Connection
) -> None:
    import aiohttp

    base = f"http://{endpoints[index % len(endpoints)]}/v3/"
    value = _b64(VALUE)
    keys = iter(range(1 << 62))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def call(method: str, body: dict[str, Any]) -> dict[str, Any]:
            async with session.post(base + method, data=json.dumps(body)) as response:
                answer: dict[str, Any] = json.loads(await response.read())
            if "error" in answer or "code" in answer:
                raise RuntimeError(f"etcd {method}: {answer}")
            return answer

        async def worker(command: Command, end: float, tally: Tally) -> None:
            rng = random.Random()
            occ = command["workload"] == "occ"
            entities = command["entities"]
            while (started := time.perf_counter()) < end:
                attempts = 1
                try:
                    if occ:
                        key = _b64(f"{ETCD_PREFIX}/e{rng.randrange(entities)}")
                        while True:
                            found = await call("kv/range", {"key": key})
                            revision = found["kvs"][0]["mod_revision"]
                            put = await call(
                                "kv/txn",
                                {
                                    "compare": [
                                        {
                                            "key": key,
                                            "target": "MOD",
                                            "result": "EQUAL",
                                            "mod_revision": revision,
                                        }
                                    ],
                                    "success": [{"request_put": {"key": key, "value": value}}],
                                },
                            )
                            if put.get("succeeded"):
                                break
                            attempts += 1
                    else:
                        key = _b64(f"{ETCD_PREFIX}/log/{index}-{next(keys)}")
                        await call("kv/put", {"key": key, "value": value})
                except Exception:
                    tally.errors += 1
                    continue
                done = time.perf_counter()
                if done <= end:
                    tally.commits += 1
                    tally.attempts += attempts
                    tally.latencies.append(done - started)

        await _serve_cells(pipe, worker)


# -- the peers' data ---------------------------------------------------------------------------


def zookeeper_entities(hosts: str, entities: int) -> None:
    from kazoo.client import KazooClient

    zk = KazooClient(hosts=hosts, timeout=30.0)
    zk.start(timeout=60)
    try:
        zk.ensure_path(f"{ZK_ROOT}/log")
        results = [zk.create_async(f"{ZK_ROOT}/e{i}", VALUE) for i in range(entities)]
        for result in results:
            result.get(timeout=60)
    finally:
        zk.stop()
        zk.close()


async def etcd_entities(endpoints: list[str], entities: int) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for i in range(entities):
            body = {"key": _b64(f"{ETCD_PREFIX}/e{i}"), "value": _b64(VALUE)}
            async with session.post(f"http://{endpoints[0]}/v3/kv/put", data=json.dumps(body)):
                pass


# -- the driver ---------------------------------------------------------------------------------


@dataclass
class Cell:
    commits_per_s: float
    p50_ms: float
    p99_ms: float
    attempts_per_commit: float
    errors: int
    cpu_us: dict[str, float] = field(default_factory=dict)
    """Waltz: CPU microseconds per commit of the server, the storage nodes together and
    the client processes together."""
    server_rss_mb: float = float("nan")


class Workers:
    """The worker processes of one system (one client each)."""

    def __init__(self, system: str, address: str, processes: int, api: str = "submit") -> None:
        context = multiprocessing.get_context("spawn")
        self.system = system
        self.pipes: list[multiprocessing.connection.Connection] = []
        self.processes: list[multiprocessing.process.BaseProcess] = []
        for index in range(processes):
            mine, theirs = context.Pipe()
            process = context.Process(
                target=worker_main, args=(system, address, index, theirs, api), daemon=True
            )
            process.start()
            self.pipes.append(mine)
            self.processes.append(process)

    async def ready(self, timeout: float = 120.0) -> None:
        for pipe in self.pipes:
            await _receive(pipe, timeout, f"a {self.system} worker to start")

    async def run(self, workload: str, k: int, seconds: float, entities: int) -> list[Result]:
        used = min(k, len(self.pipes))
        start = time.time() + 0.5
        for index in range(used):
            tasks = k // used + (1 if index < k % used else 0)
            self.pipes[index].send(
                {
                    "workload": workload,
                    "tasks": tasks,
                    "start": start,
                    "seconds": seconds,
                    "entities": entities,
                }
            )
        return [
            await _receive(pipe, seconds + 180, f"a {self.system} cell")
            for pipe in self.pipes[:used]
        ]

    def stop(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send({"stop": True})
        for process in self.processes:
            process.join(timeout=20)
            if process.is_alive():
                process.kill()
                process.join()


async def _receive(pipe: multiprocessing.connection.Connection, timeout: float, what: str) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pipe.poll():
        if loop.time() > deadline:
            raise TimeoutError(f"no answer from {what} within {timeout:.0f}s")
        await asyncio.sleep(0.02)
    return pipe.recv()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def summarize(results: list[Result], seconds: float) -> Cell:
    commits = sum(r["commits"] for r in results)
    latencies = [x for r in results for x in r["latencies"]]
    attempts = sum(r["attempts"] for r in results)
    return Cell(
        commits / seconds,
        pct(latencies, 0.5),
        pct(latencies, 0.99),
        attempts / commits if commits else float("nan"),
        sum(r["errors"] for r in results),
    )


def ratio(a: Cell | None, b: Cell | None) -> str:
    if a is None or b is None or not b.commits_per_s:
        return "-"
    return f"{a.commits_per_s / b.commits_per_s:.2f}x"


def print_table(workload: str, ks: list[int], cells: dict[tuple[str, str, int], Cell]) -> None:
    titles = {
        "occ": "occ: one optimistic update of an entity (Waltz: a transaction with a WRITE lock)",
        "append": "plain append (Waltz: a transaction without locks)",
    }
    print(f"\n{titles[workload]}")
    header = f"{'K':>3}"
    for system in SYSTEMS:
        header += f" | {LABELS[system] + ' /s':>13} {'p50':>6} {'p99':>6}"
    print(
        header + " | Waltz/ZK  Waltz/etcd | Waltz: tries/commit, CPU us/commit "
        "(server+storage+clients), server RSS MB"
    )
    for k in ks:
        line = f"{k:>3}"
        for system in SYSTEMS:
            cell = cells.get((workload, system, k))
            if cell is None:
                line += f" | {'-':>13} {'-':>6} {'-':>6}"
            else:
                line += f" | {cell.commits_per_s:>13,.0f} {cell.p50_ms:>6.1f} {cell.p99_ms:>6.1f}"
        waltz = cells.get((workload, "waltz", k))
        line += (
            f" | {ratio(waltz, cells.get((workload, 'zookeeper', k))):>8} "
            f"{ratio(waltz, cells.get((workload, 'etcd', k))):>10}"
        )
        if waltz is not None:
            cpu = waltz.cpu_us
            line += (
                f" | {waltz.attempts_per_commit:.2f}, {cpu.get('server', 0):.0f}+"
                f"{cpu.get('storage', 0):.0f}+{cpu.get('clients', 0):.0f}, "
                f"{waltz.server_rss_mb:.0f}"
            )
        errors = {
            s: c.errors
            for (w, s, kk), c in cells.items()
            if w == workload and kk == k and ":" not in s
        }
        if any(errors.values()):
            line += f"  errors {errors}"
        print(line)


def print_apis(
    workload: str, ks: list[int], apis: list[str], cells: dict[tuple[str, str, int], Cell]
) -> None:
    print(
        f"  Waltz by client API ({workload}): commits/s, p50, p99 ms, tries/commit, CPU us/commit"
    )
    for k in ks:
        for api in apis:
            cell = cells.get((workload, f"waltz:{api}", k))
            if cell is None:
                continue
            cpu = cell.cpu_us
            print(
                f"  {k:>3} {api:>14}: {cell.commits_per_s:>8,.0f} {cell.p50_ms:>6.1f} "
                f"{cell.p99_ms:>6.1f}  {cell.attempts_per_commit:.2f}  "
                f"{cpu.get('server', 0):.0f}+{cpu.get('storage', 0):.0f}+"
                f"{cpu.get('clients', 0):.0f}" + (f"  errors {cell.errors}" if cell.errors else "")
            )


def print_goals(ks: list[int], cells: dict[tuple[str, str, int], Cell]) -> None:
    print("\ngoals (issue 16; figures, never pass/fail):")
    top = max(ks)
    waltz = cells.get(("occ", "waltz", top))
    print(
        f"  occ at K={top}, at least 5x both peers: Waltz/ZooKeeper "
        f"{ratio(waltz, cells.get(('occ', 'zookeeper', top)))}, Waltz/etcd "
        f"{ratio(waltz, cells.get(('occ', 'etcd', top)))}"
    )
    low = min(ks)
    for workload in WORKLOADS:
        print(
            f"  {workload} at K={low}, at least etcd (1x): Waltz/etcd "
            f"{ratio(cells.get((workload, 'waltz', low)), cells.get((workload, 'etcd', low)))}"
        )


async def measure(
    workers: Workers,
    system: str,
    cell_of: tuple[str, int],
    *,
    args: argparse.Namespace,
    cluster: Any,
    meter: CpuMeter,
    spy_name: str,
) -> Cell:
    """One cell: ``workers`` run ``workload`` with K workers; Waltz's CPU per commit."""
    workload, k = cell_of
    spy = None
    pids = cluster.pids()
    if system == "waltz" and args.py_spy:
        worker_pid = workers.processes[0].pid
        spy = Spy(args.py_spy, spy_name, {**pids, "client0": worker_pid}, gil=args.gil)
        spy.start(args.seconds)
    meter.start()
    results = await workers.run(workload, k, args.seconds, args.entities)
    meter.stop()
    cell = summarize(results, args.seconds)
    if system == "waltz":
        commits = sum(r["commits"] for r in results)
        cell.cpu_us = meter.per_transaction_us(commits)
        if commits:
            clients = sum(r["cpu"] for r in results)
            cell.cpu_us["clients"] = clients / commits * 1e6
        cell.server_rss_mb = peak_rss_mb(cluster.server.pid)
    if spy is not None:
        spy.stop()
        print(f"  py-spy, Waltz {spy_name}:\n{spy.report()}", flush=True)
    return cell


async def main(args: argparse.Namespace) -> None:
    ks = [int(k) for k in args.ks.split(",")]
    systems = [s for s in SYSTEMS if s in args.systems.split(",")]
    from waltz_conformance.servers.etcd import EtcdCluster
    from waltz_conformance.servers.zookeeper import ZooKeeperServer

    workdir = Path(tempfile.mkdtemp(prefix="waltz-bench-peers-"))
    zookeeper = ZooKeeperServer(workdir / "zk-peer")
    etcd = EtcdCluster(workdir / "etcd-peer", 3)
    workers: dict[str, Workers] = {}
    cells: dict[tuple[str, str, int], Cell] = {}
    async with process_cluster(PARTITIONS) as cluster:
        try:
            if "zookeeper" in systems:
                zookeeper.start()
                await asyncio.to_thread(zookeeper_entities, zookeeper.connect_string, args.entities)
            if "etcd" in systems:
                await asyncio.to_thread(etcd.start)
                await etcd_entities(etcd.endpoints, args.entities)
            addresses = {
                "waltz": cluster.uri,
                "zookeeper": zookeeper.connect_string,
                "etcd": ",".join(etcd.endpoints) if "etcd" in systems else "",
            }
            apis = args.waltz_api.split(",")
            for api in apis:
                if api not in WALTZ_APIS:
                    raise SystemExit(f"--waltz-api {api!r}: one of {', '.join(WALTZ_APIS)}")
            for system in systems:
                if system != "waltz":
                    workers[system] = Workers(system, addresses[system], args.processes)
                    await workers[system].ready()
            print(
                f"Waltz: 1 server, 3 storage nodes (fs, fsync), ZooKeeper, zmq, {PARTITIONS} "
                f"partitions, client library ({apis[0]}); ZooKeeper: standalone, fsync; "
                f"etcd: 3 members. {args.entities} entities, 100-byte values, {args.seconds:.0f} s "
                f"a cell, K workers in min(K, {args.processes}) processes (one client each)"
            )
            pids = cluster.pids()
            meter = CpuMeter(
                {
                    "server": [pids["server"]],
                    "storage": [pid for role, pid in pids.items() if role != "server"],
                }
            )
            # one Waltz API's clients at a time (an idle client still consumes the feed of
            # every partition: it would load the cluster of the API measured); the peers
            # are measured beside the first
            for turn, api in enumerate(apis if "waltz" in systems else [""]):
                key = f"waltz:{api}"
                if api:
                    workers[key] = Workers("waltz", cluster.uri, args.processes, api)
                    await workers[key].ready()
                groups = [(key, "waltz", api)] if api else []
                if turn == 0:
                    groups += [(system, system, "") for system in systems if system != "waltz"]
                for workload in WORKLOADS:
                    for k in ks:
                        for group_key, system, _ in groups:
                            cells[(workload, group_key, k)] = await measure(
                                workers[group_key],
                                system,
                                (workload, k),
                                args=args,
                                cluster=cluster,
                                meter=meter,
                                spy_name=f"{workload}-K{k}-{api}",
                            )
                            if group_key == f"waltz:{apis[0]}":
                                cells[(workload, "waltz", k)] = cells[(workload, group_key, k)]
                if api:
                    workers.pop(key).stop()
            for workload in WORKLOADS:
                print_table(workload, ks, cells)
                if len(apis) > 1:
                    print_apis(workload, ks, apis, cells)
            print_goals(ks, cells)
            print(
                "(latencies in ms; the Waltz server's RSS is its peak so far; etcd through its "
                "JSON gateway, ZooKeeper through kazoo: Python clients for all three)"
            )
        finally:
            for group in workers.values():
                group.stop()
            zookeeper.cleanup()
            etcd.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per cell")
    parser.add_argument("--ks", default="1,8,32,64", help="concurrent workers, comma-separated")
    parser.add_argument("--processes", type=int, default=4, help="worker processes per system")
    parser.add_argument("--entities", type=int, default=1000)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="which systems to measure")
    parser.add_argument(
        "--waltz-api",
        default="submit",
        help=f"how Waltz workers submit, comma-separated ({', '.join(WALTZ_APIS)}); the first "
        "is the Waltz column, the others are printed beside it",
    )
    parser.add_argument(
        "--py-spy", type=Path, help="record the Waltz processes with py-spy into this directory"
    )
    parser.add_argument(
        "--gil", action="store_true", help="py-spy: only samples holding the GIL (CPU time)"
    )
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main(parser.parse_args()))
