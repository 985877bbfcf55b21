"""A separate process for the local plugin's tests: ``python local_worker.py MODE URI ...``.

Opens the client through the plugin registry (as a deployment does), does its
work and prints JSON lines. Modes:

- ``write URI N``: create /d/0../d/N-1, set each once, take N counter values;
  print {"done": ...} and wait to be killed.
- ``cas URI ROUNDS``: ROUNDS read-then-CAS attempts on /fence; print the
  (expected, new) version pairs it won.
- ``ephemeral URI PATH TIMEOUT``: create PATH ephemeral, print ready, wait to be
  killed (heartbeating); print {"lost": true} if the session is lost.
- ``setter URI N``: set /w to 1..N.
- ``busy URI``: set /busy in a loop (most of its time inside a write
  transaction), print ready after the first, until killed.
"""

from __future__ import annotations

import asyncio
import json
import sys

from waltz_api.cluster import coordination_from_uri
from waltz_api.contracts.coordination import SessionState
from waltz_api.errors import BadVersionError

MAX_LIFETIME = 300.0


def emit(message: object) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def main(mode: str, uri: str, args: list[str]) -> None:
    timeout = float(args[1]) if mode == "ephemeral" else 10.0
    client = coordination_from_uri(uri, {"session_timeout": timeout})
    await client.start()
    if mode == "write":
        count = int(args[0])
        versions = []
        for i in range(count):
            await client.create(f"/d/{i}", b"created")
            versions.append(await client.set(f"/d/{i}", f"value-{i}".encode()))
        counters = [await client.increment("/counter") for _ in range(count)]
        emit({"done": True, "versions": versions, "counters": counters})
        await asyncio.sleep(MAX_LIFETIME)
    elif mode == "cas":
        won = []
        for _ in range(int(args[0])):
            current = await client.get("/fence")
            assert current is not None
            try:
                new = await client.set(
                    "/fence", str(client.session_id).encode(), expected_version=current.version
                )
                won.append([current.version, new])
            except BadVersionError:
                pass
        emit({"won": won})
    elif mode == "ephemeral":
        lost = asyncio.Event()
        client.add_session_listener(lambda s: lost.set() if s is SessionState.LOST else None)
        await client.create(args[0], b"owned", ephemeral=True)
        emit({"ready": True, "session_id": client.session_id})
        await asyncio.wait_for(lost.wait(), MAX_LIFETIME)
        emit({"lost": True})
    elif mode == "setter":
        for i in range(1, int(args[0]) + 1):
            await client.set("/w", str(i).encode())
        emit({"done": True})
    elif mode == "busy":
        await client.create("/busy", b"0")
        emit({"ready": True})
        deadline = asyncio.get_running_loop().time() + MAX_LIFETIME
        count = 0
        while asyncio.get_running_loop().time() < deadline:
            count += 1
            await client.set("/busy", str(count).encode())
    await client.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
