"""A separate process for the coordination suite's cross-process tests.

Run as ``python -m waltz_conformance.suites.coordination_worker COMMAND URI ...``;
it opens a client through the plugin registry (chosen by the URI's scheme),
does its work and prints one JSON line.

- ``ephemeral URI PATH SESSION_TIMEOUT``: create PATH as an ephemeral entry,
  print ``{"ready": true, "session_id": ...}`` and then wait to be killed
  (at most ten minutes), heartbeating as a live owner does.
- ``race URI INCREMENTS CAS_UPDATES SESSION_TIMEOUT``: take INCREMENTS
  values of the counter ``/race/counter`` and add 1 to the integer at
  ``/race/sum`` CAS_UPDATES times with read-modify-CAS loops; print the
  counter values and the number of CAS conflicts.
"""

from __future__ import annotations

import asyncio
import json
import sys

from waltz_api.cluster import coordination_from_uri
from waltz_api.errors import BadVersionError, NodeExistsError

MAX_CAS_ATTEMPTS = 10_000
MAX_LIFETIME = 600.0


async def ephemeral(uri: str, path: str, session_timeout: float) -> None:
    client = coordination_from_uri(uri, {"session_timeout": session_timeout})
    await client.start()
    await client.create(path, b"owned by a process", ephemeral=True)
    print(json.dumps({"ready": True, "session_id": client.session_id}), flush=True)  # noqa: T201
    await asyncio.sleep(MAX_LIFETIME)
    await client.close()


async def race(uri: str, increments: int, cas_updates: int, session_timeout: float) -> None:
    client = coordination_from_uri(uri, {"session_timeout": session_timeout})
    await client.start()
    try:
        values = [await client.increment("/race/counter") for _ in range(increments)]
        conflicts = 0
        for _ in range(cas_updates):
            for _attempt in range(MAX_CAS_ATTEMPTS):
                current = await client.get("/race/sum")
                if current is None:
                    try:
                        await client.create("/race/sum", b"1")
                        break
                    except NodeExistsError:
                        conflicts += 1
                        continue
                try:
                    await client.set(
                        "/race/sum",
                        str(int(current.value) + 1).encode(),
                        expected_version=current.version,
                    )
                    break
                except BadVersionError:
                    conflicts += 1
            else:
                raise RuntimeError("no CAS succeeded")
        print(json.dumps({"values": values, "conflicts": conflicts}), flush=True)  # noqa: T201
    finally:
        await client.close()


def main(argv: list[str]) -> int:
    command, uri, *rest = argv
    if command == "ephemeral":
        asyncio.run(ephemeral(uri, rest[0], float(rest[1])))
    elif command == "race":
        asyncio.run(race(uri, int(rest[0]), int(rest[1]), float(rest[2])))
    else:
        raise SystemExit(f"unknown command {command!r}; use ephemeral or race")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
