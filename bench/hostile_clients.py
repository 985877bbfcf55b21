"""A server's memory against clients that stop reading (figures only, never pass/fail).

A ``waltz dev`` cluster (one partition, one server, three fs storage nodes, zmq on
loopback). A client in this process commits small transactions steadily (the good
client); one 1 MiB transaction is committed first for the attackers to ask for. For
each case a hostile client process (``packages/waltz-server/tests/hostile_client.py``)
attacks the server while the good client commits for ``--seconds``; the server's RSS
is sampled every 0.1 s. The reference, measured in the same run, is the same load
without an attacker.

Cases (the attacker never reads what the server sends):

- ``data``: pipelines ``--requests`` TransactionDataRequests of the 1 MiB transaction
  (that many MiB of replies) with its event loop running (heartbeats answered);
- ``data-absurd``: the same, announcing a receive window of 2**32-1 frames and
  2**62 bytes in its HELLO;
- ``data-absurd-frozen``: the same, then stops running (nothing read from the socket);
- ``feed-absurd``: mounts the partition from -1 with the absurd window and never reads
  its feed, while the good client appends.

Printed per case: server RSS at the start, its peak and the growth, and the good
client's commits/s.

    .venv/bin/python bench/hostile_clients.py [--seconds 8] [--requests 400]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

from waltz_api.cluster import ClusterMetadata, coordination_from_uri
from waltz_client import (
    AsyncWaltzClient,
    ClientConfig,
)
from waltz_client.simple import MemoryMarks as Marks
from waltz_client.simple import Put

HOSTILE = Path(__file__).parent.parent / "packages/waltz-server/tests/hostile_client.py"
MIB = 1024 * 1024
CASES = {
    "data": ("data", []),
    "data-absurd": ("data", ["--absurd-window"]),
    "data-absurd-frozen": ("data", ["--absurd-window", "--freeze"]),
    "feed-absurd": ("feed", ["--absurd-window"]),
}


def load_hostile() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hostile_client", HOSTILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def commit_for(client: AsyncWaltzClient, seconds: float, window: int = 16) -> int:
    """Commit 100-byte transactions for ``seconds`` (``window`` in flight); how many."""
    done = 0
    stop = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < stop:
            await client.submit(Put(b"g" * 100))
            done += 1

    await asyncio.gather(*(worker() for _ in range(window)))
    return done


class Sampler:
    """The peak RSS of ``pid``, sampled every 0.1 s in a thread."""

    def __init__(self, hostile: ModuleType, pid: int) -> None:
        self.hostile, self.pid = hostile, pid
        self.peak = self.start = hostile.rss_bytes(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, self.hostile.rss_bytes(self.pid))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


async def run(args: argparse.Namespace) -> None:
    hostile = load_hostile()
    with (
        tempfile.TemporaryDirectory(prefix="waltz-hostile-") as base,
        hostile.dev_cluster(Path(args.keep or base), "--partitions", "1") as info,
    ):
        server = hostile.role_pid(info["child_pids"], "server")
        endpoint = info["servers"][0]
        coordination = coordination_from_uri(info["coordination"])
        await coordination.start()
        generation = (await ClusterMetadata(coordination).partition_assignment(0)).value.generation
        await coordination.close()
        config = ClientConfig(info["coordination"], transport="zmq")
        async with AsyncWaltzClient(Marks(), config) as client:
            big = (await client.submit(Put(b"B" * MIB))).transaction_id
            await commit_for(client, 2.0)  # warm up
            rows = []
            for case in ["reference", *args.cases]:
                attacker = None
                sampler = Sampler(hostile, server)
                if case != "reference":
                    mode, flags = CASES[case]
                    attacker = hostile.Attacker(
                        endpoint, mode, "0", str(generation), str(big),
                        str(args.requests), *flags,
                    )  # fmt: skip
                    await asyncio.to_thread(attacker.wait_sent)
                commits = await commit_for(client, args.seconds)
                sampler.stop()
                if attacker is not None:
                    attacker.stop()
                rows.append((case, sampler.start, sampler.peak, commits / args.seconds))
                await asyncio.sleep(1.0)  # the server settles between cases
    print(f"server RSS per case, {args.seconds:g} s each, attacker asks {args.requests} MiB")
    print(f"{'case':<20} {'start MiB':>10} {'peak MiB':>10} {'growth MiB':>11} {'commits/s':>10}")
    for case, start, peak, rate in rows:
        print(
            f"{case:<20} {start / MIB:>10.1f} {peak / MIB:>10.1f} {(peak - start) / MIB:>11.1f} "
            f"{rate:>10,.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--cases", type=lambda v: v.split(","), default=list(CASES))
    parser.add_argument("--keep", help="run the cluster in this directory (kept: its logs)")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
