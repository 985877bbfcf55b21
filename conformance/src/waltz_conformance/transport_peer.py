"""A transport peer in its own process, for the transport conformance suite.

``python -m waltz_conformance.transport_peer PLUGIN ENDPOINT OPTIONS_JSON`` loads
the transport plugin PLUGIN, listens on ENDPOINT, echoes every frame of every
connection back to its sender, and writes ``READY <resolved endpoint>`` on
stdout once it listens. It stops on SIGTERM, and on its own when its parent
process goes away (so a crashed test run leaves no peer behind).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from typing import Any

from waltz_api.contracts.transport import Connection
from waltz_api.errors import ConnectionClosedError
from waltz_api.plugins import get_registry

log = logging.getLogger(__name__)


async def echo(conn: Connection) -> None:
    """Send every frame back, in order, until the connection ends."""
    try:
        while True:
            frame = await conn.recv()
            await conn.send(frame)
    except ConnectionClosedError:
        return


async def serve(plugin: str, endpoint: str, options: dict[str, Any]) -> None:
    transport = get_registry().get("transport", plugin).factory(options)
    listener = await transport.listen(endpoint, echo)
    sys.stdout.write(f"READY {listener.endpoint}\n")
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    parent = os.getppid()
    try:
        while not stop.is_set():
            if os.getppid() != parent:
                log.warning("the parent process is gone; the transport peer stops")
                break
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except TimeoutError:
                continue
    finally:
        await transport.close()


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        sys.stderr.write(
            "usage: python -m waltz_conformance.transport_peer PLUGIN ENDPOINT OPTIONS_JSON\n"
        )
        return 2
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    plugin, endpoint, options_json = argv
    asyncio.run(serve(plugin, endpoint, json.loads(options_json)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
