"""A Waltz cluster of real processes for the benchmarks: a ZooKeeper, three
``waltz storage`` nodes (fs engine, real fsync) and one ``waltz server``, all over
ZeroMQ on loopback. Used by ``append.py`` (the raw protocol) and ``client.py
--processes`` (the client library beside it)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from waltz_api.cluster import coordination_from_uri
from waltz_api.contracts.coordination import Coordination
from waltz_api.contracts.transport import Transport
from waltz_api.plugins import get_registry
from waltz_api.ports import free_port
from waltz_api.storage_client import StorageAdminClient
from waltz_conformance.servers.zookeeper import ZooKeeperServer
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.server.testing import ServerProcess
from waltz_storage_node.testing import StorageNodeProcess


def peak_rss_mb(pid: int | None) -> float:
    """A process's peak resident set size (VmHWM), in MB."""
    if pid is None:
        return float("nan")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class ProcessCluster:
    uri: str
    coordination: Coordination
    metadata: ClusterAdmin
    transport: Transport
    server: ServerProcess
    workdir: Path
    storage: list[StorageNodeProcess]

    async def storage_counters(self, node: int = 0) -> dict[str, int]:
        """Storage node ``node``'s request counters (admin ``stats``), summed over its
        partitions: requests, append_requests, engine_appends, records_appended."""
        async with await StorageAdminClient.connect(
            self.transport, self.storage[node].endpoint
        ) as admin:
            stats = await admin.command("stats")
        totals: dict[str, int] = {}
        for partition in stats["partitions"]:
            for key, value in partition.items():
                if key != "partition_id" and isinstance(value, int):
                    totals[key] = totals.get(key, 0) + value
        return totals

    def pids(self) -> dict[str, int | None]:
        """The cluster's processes by role: ``server``, ``storage0``.."""
        return {"server": self.server.pid} | {
            f"storage{i}": node.pid for i, node in enumerate(self.storage)
        }


@contextlib.asynccontextmanager
async def process_cluster(
    partitions: int = 4, server_options: Sequence[str] = ()
) -> AsyncIterator[ProcessCluster]:
    """Start the cluster, wait until every partition is assigned; stop it by pid after.
    ``server_options``: lines of the server's ``[server]`` config section."""
    workdir = Path(tempfile.mkdtemp(prefix="waltz-bench-cluster-"))
    zookeeper = ZooKeeperServer(workdir / "zk")
    zookeeper.start()
    storage: list[StorageNodeProcess] = []
    server: ServerProcess | None = None
    transport: Transport = get_registry().get("transport", "zmq").factory({})
    coordination: Coordination | None = None
    try:
        uri = zookeeper.uri("/bench")
        key = uuid.uuid4()
        ports = [free_port() for _ in range(3)]
        coordination = coordination_from_uri(uri)
        await coordination.start()
        metadata = ClusterAdmin(coordination)
        await metadata.create_cluster(
            num_partitions=partitions,
            num_replicas=3,
            storage_nodes=[f"127.0.0.1:{p}" for p in ports],
            cluster_key=key,
        )
        listed = ", ".join(str(p) for p in range(partitions))
        for i, port in enumerate(ports):
            config = workdir / f"storage{i}.toml"
            config.write_text(
                f'log_level = "WARNING"\n[storage]\ndata_dir = "{workdir / f"data{i}"}"\n'
                f'engine = "fs"\ncluster_key = "{key}"\nnum_partitions = {partitions}\n'
                f'partitions = [{listed}]\n[transport]\nplugin = "zmq"\n'
                f'endpoint = "tcp://127.0.0.1:{port}"\n'
            )
            node = StorageNodeProcess(config, f"tcp://127.0.0.1:{port}", workdir / f"s{i}.log")
            node.start()
            storage.append(node)
        for node in storage:
            await node.wait_ready(transport)
        config = workdir / "server.toml"
        config.write_text(
            f'log_level = "WARNING"\n[coordination]\nuri = "{uri}"\n[transport]\n'
            f'plugin = "zmq"\nendpoint = "tcp://127.0.0.1:{free_port()}"\n'
            'storage_endpoint = "tcp://{}"\n'
            "[server]\n" + "".join(f"{option}\n" for option in server_options)
        )
        server = ServerProcess(config, workdir / "server.log")
        server.start()
        for _ in range(600):
            owners = [(await metadata.partition_assignment(p)).value for p in range(partitions)]
            if all(o.server_id >= 0 for o in owners):
                break
            await asyncio.sleep(0.1)
        yield ProcessCluster(uri, coordination, metadata, transport, server, workdir, storage)
    finally:
        if coordination is not None:
            with contextlib.suppress(Exception):
                await coordination.close()
        if server is not None:
            server.kill()
        for node in storage:
            node.kill()
        await transport.close()
        zookeeper.stop()
    # the data directories (each node's journal is 32 MiB): kept only when the run failed,
    # for its logs (an exception skips this line)
    shutil.rmtree(workdir, ignore_errors=True)
