"""A hostile Waltz client, run as its own process by the bounded-memory test and
``bench/hostile_clients.py`` (which also use the helpers below: a ``waltz dev``
cluster, a process's RSS, an attacker process stopped by its pid)::

    python hostile_client.py ENDPOINT MODE PARTITION GENERATION TRANSACTION COUNT [--absurd-window]

It connects on the zmq transport (announcing a receive window of 2**32-1 frames and
2**62 bytes with ``--absurd-window``), completes the Waltz handshake, then:

- ``data``: sends COUNT TransactionDataRequests of TRANSACTION without reading a reply;
- ``feed``: mounts PARTITION from transaction -1 (the whole log streams to it) and
  never reads its feed.

It prints ``SENT`` when done, then ``stall`` keeps its event loop running (the
transport answers heartbeats; the application reads nothing) until killed.
With ``--freeze`` it stops running altogether (``time.sleep``): nothing is read from
the socket.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from waltz_api import wire
from waltz_api.messages import MountRequest, TransactionDataRequest
from waltz_api.supervised import SupervisedProcess
from waltz_api.types import ReqId
from waltz_transport_zmq import ZmqTransport

ABSURD = {"window_frames": 2**32 - 1, "window_bytes": 2**62}


# -- helpers of the test and the benchmark ------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """The resident set of process ``pid`` (Linux /proc)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def role_pid(pids: list[int], role: str) -> int:
    """The child of ``waltz dev`` running ``waltz ROLE`` (server, storage...)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if role.encode() in argv:
                return pid
    raise RuntimeError(f"no `waltz {role}` among {pids}")


@contextlib.contextmanager
def dev_cluster(base: Path, *args: str, timeout: float = 120.0) -> Iterator[dict[str, Any]]:
    """A ``waltz dev`` in ``base`` (its child processes); its ready information. Stopped
    with SIGINT (then SIGKILL, every child by its pid) on exit."""
    from waltz_server.dev import read_ready_file

    data_dir = base / ".waltz-dev"
    dev = SupervisedProcess(
        [sys.executable, "-m", "waltz_server.cli", "dev", "--data-dir", str(data_dir), *args],
        base / "dev.log",
        name="waltz dev",
    )
    dev.start()
    ready: dict[str, Any] = {}

    def started() -> bool:
        info = read_ready_file(data_dir)
        if info is None or info["pid"] != dev.pid:
            return False
        ready.update(info)
        return True

    try:
        dev.wait_ready_sync(started, timeout=timeout, interval=0.1)
        yield ready
        dev.terminate(timeout=60, signum=signal.SIGINT)
    finally:
        dev.kill()
        for pid in ready.get("child_pids", []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class Attacker:
    """This script in a child process; :meth:`stop` kills it by its pid."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, *args],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )

    def wait_sent(self, timeout: float = 60.0) -> None:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        line = ""
        while not line.startswith("SENT"):
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"the hostile client did not send (exit {self.process.poll()})")
            line = self.process.stdout.readline()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        if self.process.stdout is not None:
            self.process.stdout.close()


async def main(args: argparse.Namespace) -> None:
    transport = ZmqTransport()
    if args.absurd_window:  # announced in the HELLO; its own sockets keep sane settings
        transport.opts = dataclasses.replace(
            transport.opts, **ABSURD, high_water_mark=transport.opts.hwm
        )
    conn = await transport.connect(args.endpoint, timeout=30)
    protocol = wire.ProtocolConnection(wire.Role.INITIATOR, sender="hostile")
    await conn.send(protocol.start_handshake())
    protocol.receive_frame(await asyncio.wait_for(conn.recv(), 30))
    client_id = 900_000 + args.partition
    if args.mode == "data":
        for seq in range(args.count):
            request = TransactionDataRequest(
                ReqId(client_id, args.generation, args.partition, seq), args.transaction
            )
            await conn.send(protocol.send(request))
    else:
        mount = MountRequest(ReqId(client_id, args.generation, args.partition, 1), -1, 1)
        await conn.send(protocol.send(mount))
    await asyncio.sleep(0.5)  # the transport flushes what this loop iteration coalesced
    print("SENT", flush=True)  # noqa: T201 - the parent waits for this line
    if args.freeze:
        time.sleep(3600)  # noqa: ASYNC251 - on purpose: the loop (and the reading) stops
    await asyncio.sleep(3600)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("mode", choices=["data", "feed"])
    parser.add_argument("partition", type=int)
    parser.add_argument("generation", type=int)
    parser.add_argument("transaction", type=int)
    parser.add_argument("count", type=int)
    parser.add_argument("--absurd-window", action="store_true")
    parser.add_argument("--freeze", action="store_true")
    asyncio.run(main(parser.parse_args(sys.argv[1:])))
