"""A Waltz server's cluster manager alone, in its own process, for kill -9 tests.

    python cluster_manager_worker.py COORDINATION_URI ENDPOINT

Prints ``registered <server id>`` once registered, then one line per partition
event (``gained <partition> <generation>`` / ``lost <partition> <generation>``),
and runs until killed.
"""

from __future__ import annotations

import asyncio
import sys

from waltz_api.cluster import coordination_from_uri
from waltz_server.server.cluster_manager import ClusterManager, PartitionEvent, PartitionGained


async def main(uri: str, endpoint: str) -> None:
    async def report(event: PartitionEvent) -> None:
        kind = "gained" if isinstance(event, PartitionGained) else "lost"
        sys.stdout.write(f"{kind} {event.partition_id} {event.generation}\n")
        sys.stdout.flush()

    manager = ClusterManager(lambda: coordination_from_uri(uri), endpoint, on_event=report)
    await manager.start()
    sys.stdout.write(f"registered {manager.server_id}\n")
    sys.stdout.flush()
    try:
        await asyncio.Event().wait()
    finally:
        await manager.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
