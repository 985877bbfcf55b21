"""The cluster's feature level as a server follows it (``waltz_api.features``).

Read when the server starts (a server refuses a cluster above the levels it supports)
and followed by a watch on the coordination client of the server's ACL
(:class:`~waltz_server.server.access.AccessGate`). A server at level 1 speaks and writes
what 0.1.0 did; once the level is 2 it tells every storage node it is connected to (and
each it connects to later) to write the level's formats (admin command
``set_feature_level``), and its store sessions send ``MarkReplicaRequest``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from waltz_api.cluster import ClusterMetadata
from waltz_api.contracts.coordination import Watch
from waltz_api.errors import ConfigError, StorageError, WaltzError
from waltz_api.features import MARK_REPLICA_LEVEL, MAX_FEATURE_LEVEL, MIN_FEATURE_LEVEL

if TYPE_CHECKING:
    from waltz_api.storage_client import StorageAdminClient, StorageClient

log = logging.getLogger(__name__)


def check_supported(level: int) -> int:
    """``level`` (the cluster's recorded one) when this code supports it; ConfigError
    saying what to do otherwise."""
    if level > MAX_FEATURE_LEVEL:
        raise ConfigError(
            f"the cluster is at feature level {level}, above the highest this Waltz supports "
            f"({MAX_FEATURE_LEVEL}): a newer release raised it; run that release (a level is "
            "never lowered)",
            key="feature_level",
        )
    return level


class ClusterFeatures:
    """The cluster feature level this server works at: the recorded one (it never goes
    down here), at most :data:`MAX_FEATURE_LEVEL`."""

    def __init__(self, level: int = MIN_FEATURE_LEVEL) -> None:
        self.level = min(level, MAX_FEATURE_LEVEL)
        self._listeners: list[Callable[[int], Awaitable[None]]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def __call__(self) -> int:
        return self.level

    def on_raise(self, listener: Callable[[int], Awaitable[None]]) -> None:
        """Run ``listener(new level)`` (a task) whenever the level rises."""
        self._listeners.append(listener)

    async def close(self) -> None:
        """Cancel the listeners still running."""
        tasks, self._tasks = list(self._tasks), set()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def follow(self, metadata: ClusterMetadata) -> Watch:
        """Watch the recorded level (a follower of the ACL's coordination client)."""
        return await metadata.watch_feature_level(self.apply)

    def apply(self, recorded: int) -> None:
        if recorded > MAX_FEATURE_LEVEL:
            log.error(
                "the cluster's feature level was raised to %d, above the highest this server "
                "supports (%d): it keeps working at level %d; upgrade it",
                recorded,
                MAX_FEATURE_LEVEL,
                MAX_FEATURE_LEVEL,
            )
        level = min(recorded, MAX_FEATURE_LEVEL)
        if level <= self.level:
            return
        before, self.level = self.level, level
        log.info("cluster feature level %d (was %d)", level, before)
        for listener in self._listeners:
            task = asyncio.get_running_loop().create_task(
                _logged(listener(level)), name="waltz-feature-level"
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


async def _logged(work: Awaitable[None]) -> None:
    try:
        await work
    except WaltzError as exc:
        log.warning("after the feature level rose: %s", exc)


async def tell_storage_node(
    admin: StorageAdminClient, storage_node: str, level: int, cluster_key: uuid.UUID
) -> bool:
    """Tell a storage node the cluster's feature level (admin ``set_feature_level``);
    whether it took it. A node that cannot (an older release) is logged, and used as it
    is: it writes what it wrote."""
    try:
        await admin.set_feature_level(level, cluster_key)
    except StorageError as exc:
        log.error(
            "storage node %s cannot write at the cluster's feature level %d (an older "
            "release?): %s; upgrade it",
            storage_node,
            level,
            exc,
        )
        return False
    return True


async def mark_at_level(
    client: StorageClient,
    level: int,
    session_id: int,
    partition_id: int,
    low_water_mark: int,
    *,
    clean: bool,
    log_end: int,
) -> None:
    """A replica's MarkReplicaRequest at cluster feature ``level``: sent from level 2 on.
    Below it (a storage node of 0.1.0 closes the connection on that message) as 0.1.0
    did: a suspect replica gets the session's marks (SetLowWaterMark), so a later
    recovery may count it as a voter before it caught up (the gap level 2 closes);
    marking it clean again writes nothing."""
    if level >= MARK_REPLICA_LEVEL:
        await client.mark_replica(
            session_id, partition_id, low_water_mark, clean=clean, log_end=log_end
        )
    elif not clean:
        await client.set_low_water_mark(session_id, partition_id, low_water_mark)
