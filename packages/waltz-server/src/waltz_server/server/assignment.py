"""The partition assignment the leader aims for: a pure function of the live servers,
their preferred partitions and the current owners (deterministic: every server
computes the same). Split from :mod:`waltz_server.server.cluster_manager`, whose
leader writes it (each change a compare-and-set)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from waltz_api.cluster import NO_SERVER, ServerInfo
from waltz_api.errors import ConfigError, CoordinationError


def compute_assignment(
    num_partitions: int, servers: Sequence[ServerInfo], current: Mapping[int, int]
) -> dict[int, int]:
    """The partition -> server id assignment the leader aims for.

    - A partition preferred by live servers goes to the lowest-id one of them.
    - The other partitions are spread so that every server without more
      preferred partitions than that holds the same number, give or take one.
    - A partition stays with its ``current`` owner whenever that owner is live
      and within its share, so a change of membership moves as few as possible.

    ``current`` maps a partition to its owner (missing or :data:`NO_SERVER` when
    unassigned; owners not in ``servers`` are dead). Deterministic: the same
    input gives the same answer on every server. Empty when no server is live.
    """
    if num_partitions < 0:
        raise ConfigError(f"the number of partitions must be non-negative, got {num_partitions}")
    ids = sorted({s.server_id for s in servers})
    if not ids:
        return {}
    target: dict[int, int] = {}
    for server in sorted(servers, key=lambda s: s.server_id):
        for partition in server.preferred_partitions:
            if 0 <= partition < num_partitions and partition not in target:
                target[partition] = server.server_id
    load = dict.fromkeys(ids, 0)
    for owner in target.values():
        load[owner] += 1
    free = [p for p in range(num_partitions) if p not in target]

    def room(level: int) -> int:
        return sum(max(0, level - load[s]) for s in ids)

    # The water level: every server is filled up to `level`; `extra` servers get one more.
    level = 0
    while level < num_partitions and room(level + 1) <= len(free):
        level += 1
    extra = len(free) - room(level)

    unplaced: list[int] = []
    for partition in free:  # keep what is within its owner's share
        owner = current.get(partition, NO_SERVER)
        if owner in load and load[owner] < level:
            target[partition] = owner
            load[owner] += 1
        else:
            unplaced.append(partition)
    rest: list[int] = []
    for partition in unplaced:  # and one more, while servers may hold level + 1
        owner = current.get(partition, NO_SERVER)
        if extra > 0 and owner in load and load[owner] == level:
            target[partition] = owner
            load[owner] += 1
            extra -= 1
        else:
            rest.append(partition)
    for partition in rest:
        below = [s for s in ids if load[s] < level]
        if below:
            chosen = min(below, key=lambda s: (load[s], s))
        else:
            at_level = [s for s in ids if load[s] == level]
            if extra <= 0 or not at_level:  # cannot happen: the room is exactly len(free)
                raise CoordinationError(f"no server has room for partition {partition}")
            chosen = at_level[0]
            extra -= 1
        target[partition] = chosen
        load[chosen] += 1
    return target
