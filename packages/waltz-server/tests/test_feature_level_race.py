"""The feature level's raise against a server registering at the same time (issue 32),
on the embedded ``local`` coordination: the raise reads the level's version, checks,
and writes on that version; a server confirms the level after registering by writing it
back on the version it read. Both interleavings are forced with events (no timing):
either the raise sees the registration, or the server sees the raise."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from waltz_api.cluster import FEATURES_PATH, SERVERS_DIR, coordination_from_uri
from waltz_api.errors import ConfigError, WaltzError
from waltz_server.cluster_admin import ClusterAdmin

pytestmark = pytest.mark.timeout(120)

DEADLINE = 30.0  # for one interleaving's event on a slow, loaded machine


@pytest.fixture
async def admins(tmp_path: Path) -> AsyncIterator[tuple[ClusterAdmin, ClusterAdmin]]:
    """The operator's and a server's admin, two clients of one cluster at level 1."""
    uri = f"local://{tmp_path}?root=/race-{uuid.uuid4().hex[:8]}"
    clients = [coordination_from_uri(uri), coordination_from_uri(uri)]
    for client in clients:
        await client.start()
    operator, server = ClusterAdmin(clients[0]), ClusterAdmin(clients[1])
    await operator.create_cluster(
        num_partitions=1, num_replicas=1, storage_nodes=["127.0.0.1:1"], feature_level=1
    )
    try:
        yield operator, server
    finally:
        for client in clients:
            await client.close()


def after_listing_servers(admin: ClusterAdmin, hook: Callable[[], Awaitable[None]]) -> None:
    """Run ``hook`` once, right after ``admin`` listed the servers (the raise's check)
    and before that listing reaches it."""
    client = admin.coordination
    children = client.children
    done = False

    async def listing(path: str) -> list[str]:
        nonlocal done
        found = await children(path)
        if path == SERVERS_DIR and not done:
            done = True
            await hook()
        return found

    client.children = listing  # type: ignore[method-assign]


async def test_the_raise_sees_a_server_that_registered_after_its_check(
    admins: tuple[ClusterAdmin, ClusterAdmin],
) -> None:
    """The server registers (and confirms level 1) after the raise's check listed the
    servers and before its write: the write fails, the next check sees the server."""
    operator, server = admins
    checks = 0

    async def check() -> None:
        nonlocal checks
        checks += 1

    async def register() -> None:
        assert await server.register_server(7, "tcp://127.0.0.1:7", max_feature_level=1) == 1

    after_listing_servers(operator, register)
    with pytest.raises(WaltzError, match=r"stays 1, not raised to 2: server 7 .* at most"):
        await operator.raise_feature_level(2, check)
    assert checks == 2  # the write failed once; the second check found the server
    assert (await operator.feature_level()).value == 1
    assert [s.server_id for s in await operator.servers()] == [7]


async def test_a_server_sees_a_raise_written_between_its_read_and_confirmation(
    admins: tuple[ClusterAdmin, ClusterAdmin],
) -> None:
    """The server registers after the raise's check and reads level 1; the raise writes
    level 2 before the server confirms: the confirmation fails, the server reads 2 and
    deregisters with a line naming both levels."""
    operator, server = admins
    about_to_confirm, go_on = asyncio.Event(), asyncio.Event()
    client = server.coordination
    original = client.set

    async def held_set(path: str, value: bytes, *, expected_version: int | None = None) -> int:
        if path == FEATURES_PATH and not go_on.is_set():
            about_to_confirm.set()
            await go_on.wait()
        return await original(path, value, expected_version=expected_version)

    client.set = held_set  # type: ignore[method-assign]
    registering: list[asyncio.Task[int]] = []

    async def register_up_to_the_confirmation() -> None:
        registering.append(
            asyncio.create_task(server.register_server(8, "tcp://127.0.0.1:8", max_feature_level=1))
        )
        async with asyncio.timeout(DEADLINE):
            await about_to_confirm.wait()

    after_listing_servers(operator, register_up_to_the_confirmation)
    assert await operator.raise_feature_level(2) == (1, 2)
    go_on.set()
    with pytest.raises(ConfigError) as refused:
        async with asyncio.timeout(DEADLINE):
            await registering[0]
    assert str(refused.value).startswith(
        "server 8 supports feature level 1 at most and the cluster is at feature level 2"
    )
    assert "deregistered" in str(refused.value)
    assert await operator.servers() == []
    assert (await operator.feature_level()).value == 2


async def test_a_server_that_registers_after_a_raise_refuses(
    admins: tuple[ClusterAdmin, ClusterAdmin],
) -> None:
    operator, server = admins
    assert await operator.raise_feature_level(2) == (1, 2)
    with pytest.raises(ConfigError, match="at most and the cluster is at feature level 2"):
        await server.register_server(9, "tcp://127.0.0.1:9", max_feature_level=1)
    assert await operator.servers() == []
    # one of this release registers and confirms (the value as it was, a new version)
    before = await operator.feature_level()
    assert await server.register_server(10, "tcp://127.0.0.1:10") == 2
    after = await operator.feature_level()
    assert after.value == 2 and after.version > before.version


async def test_a_server_of_0_1_0_registering_during_the_write_is_reported(
    admins: tuple[ClusterAdmin, ClusterAdmin],
) -> None:
    """A server of 0.1.0 does not confirm the level: registered between the check and
    the write, it is named after the write (the level stays raised)."""
    operator, server = admins
    old = b'{"format":1,"type":"server","server_id":11,"endpoint":"tcp://127.0.0.1:11"}'
    client = operator.coordination
    original = client.set

    async def set_then_register(
        path: str, value: bytes, *, expected_version: int | None = None
    ) -> int:
        version = await original(path, value, expected_version=expected_version)
        if path == FEATURES_PATH:  # 0.1.0 registers, reading no level
            await server.coordination.create("/servers/11", old, ephemeral=True)
        return version

    client.set = set_then_register  # type: ignore[method-assign]
    with pytest.raises(
        WaltzError,
        match=r"feature level 2 is recorded \(was 1\), but server 11 of 0.1.0 registered",
    ):
        await operator.raise_feature_level(2)
