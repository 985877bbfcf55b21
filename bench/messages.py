"""Transport messages per storage node and per client: how well frames are packed.

A whole cluster in this process (``InProcessCluster``: three storage nodes, fs engine,
real fsync, one server, ZeroMQ on loopback, 4 partitions) and one
:class:`AsyncWaltzClient` with K workers appending transactions without locks, the
partitions in turn. Every ZeroMQ data message received is counted where it arrives
(``ZmqConnection.on_message``), with the frames it carries:

- server -> storage node: messages and frames per storage node (the frames are storage
  requests: an append batch of one partition each), and per commit;
- storage node -> server: the replies;
- server -> client: messages and frames (feed frames and replies), and per commit.

The CPU time of this process per commit is printed too (everything runs in it: the
storage nodes' committer threads included). A message carrying the frames of several
partitions is the packing issue 31 asks for ("one request per storage node per round
for all of a server's partitions on that node; one feed frame per client per round
across partitions"). Figures only, never pass/fail::

    .venv/bin/python bench/messages.py [--seconds 5] [--ks 1,64]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from waltz_client import (
    AsyncWaltzClient,
    ClientConfig,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClientCallbacks,
)
from waltz_dev.inprocess import InProcessCluster
from waltz_transport_zmq import connection as zmq_connection

PARTITIONS = 4
VALUE = b"v" * 100

counts: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0])
"""id of a receiving connection -> [data messages, frames]."""
owners: dict[int, Any] = {}


def _count_messages() -> None:
    original = zmq_connection.ZmqConnection.on_message
    data, batch = zmq_connection._DATA, zmq_connection._BATCH

    def on_message(self: zmq_connection.ZmqConnection, message: bytes) -> None:
        kind = message[0] if message else -1
        if kind in (data, batch):
            tally = counts[id(self)]
            owners[id(self)] = self
            tally[0] += 1
            tally[1] += 1 if kind == data else _batch_frames(message)
        original(self, message)

    zmq_connection.ZmqConnection.on_message = on_message  # type: ignore[method-assign]


def _batch_frames(message: bytes) -> int:
    from waltz_transport_zmq import protocol

    return len(protocol.unpack_batch(message, 1 << 30))


class Applied(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.marks: dict[int, int] = {}

    async def client_high_water_mark(self, partition_id: int) -> int:
        return self.marks.get(partition_id, -1)

    async def apply_transaction(self, transaction: Transaction) -> None:
        self.marks[transaction.partition_id] = transaction.transaction_id


class Append(TransactionContext):
    def __init__(self, partition: int) -> None:
        super().__init__()
        self.partition = partition

    def partition_id(self, num_partitions: int) -> int:
        return self.partition % num_partitions

    async def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_data(VALUE)
        return True


def _classify(cluster: InProcessCluster, server_port: str) -> dict[str, list[int]]:
    """Sum the counts by direction: a connection's peer (its endpoint) tells it."""
    storage_ports = {connect.rsplit(":", 1)[1] for connect in cluster.storage_connects}
    out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for key, (messages, frames) in counts.items():
        conn = owners[key]
        peer = conn.peer
        port = peer.rsplit(":", 1)[-1]
        if isinstance(conn, zmq_connection.ClientConnection):
            if port in storage_ports:
                direction = "storage -> server"
            elif port == server_port:
                direction = "server -> client"
            else:
                direction = "other"
        else:  # accepted: its peer reads "<listening endpoint><-<client>#<seq>"
            listening = peer.split("<-", 1)[0].rsplit(":", 1)[-1]
            direction = "server -> storage" if listening in storage_ports else "client -> server"
        tally = out[direction]
        tally[0] += messages
        tally[1] += frames
    return out


async def run(seconds: float, k: int) -> None:
    with tempfile.TemporaryDirectory(prefix="waltz-bench-messages-") as tmp:
        await _run(Path(tmp), seconds, k)


async def _run(root: Path, seconds: float, k: int) -> None:
    cluster = InProcessCluster(root, num_partitions=PARTITIONS, log_level="ERROR")
    await cluster.start()
    try:
        config = ClientConfig(cluster.coordination_uri, transport="zmq")
        async with AsyncWaltzClient(Applied(), config) as client:
            for partition in range(PARTITIONS):
                await client.flush(partition)
            turn = itertools.count()
            counts.clear()
            commits = 0
            cpu = time.process_time()
            end = time.perf_counter() + seconds

            async def worker() -> None:
                nonlocal commits
                while time.perf_counter() < end:
                    result = await client.submit(Append(next(turn)))
                    if result:
                        commits += 1

            await asyncio.gather(*(worker() for _ in range(k)))
            cpu = time.process_time() - cpu
            server_port = _server_port(counts, cluster)
            totals = _classify(cluster, server_port)
    finally:
        await cluster.close()
    print(
        f"K={k}: {commits} commits in {seconds:.0f} s ({commits / seconds:.0f}/s), "
        f"CPU {cpu / max(commits, 1) * 1e6:.0f} us per commit (the whole cluster and client)"
    )
    for direction in ("server -> storage", "storage -> server", "server -> client"):
        messages, frames = totals.get(direction, [0, 0])
        per_node = 3 if "storage" in direction else 1
        print(
            f"  {direction:<18} messages {messages:>8}  frames {frames:>8}  "
            f"frames/message {frames / max(messages, 1):>5.2f}  "
            f"messages per commit{' per node' if per_node > 1 else ''} "
            f"{messages / per_node / max(commits, 1):>5.2f}"
        )


def _server_port(tallies: dict[int, list[int]], cluster: InProcessCluster) -> str:
    """The server's port: the peer of the client's connections that are not to storage."""
    storage_ports = {connect.rsplit(":", 1)[1] for connect in cluster.storage_connects}
    ports: collections.Counter[str] = collections.Counter()
    for key in tallies:
        conn = owners[key]
        if isinstance(conn, zmq_connection.ClientConnection):
            port = conn.peer.rsplit(":", 1)[-1]
            if port not in storage_ports:
                ports[port] += tallies[key][0]
    return ports.most_common(1)[0][0] if ports else ""


async def main(args: argparse.Namespace) -> None:
    _count_messages()
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; in-process cluster: 3 storage "
        f"nodes (fs, fsync), 1 server, zmq, {PARTITIONS} partitions; appends without locks, "
        "the partitions in turn, through AsyncWaltzClient.submit"
    )
    for k in (int(x) for x in args.ks.split(",")):
        await run(args.seconds, k)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--ks", default="1,64")
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(main(parser.parse_args()))
