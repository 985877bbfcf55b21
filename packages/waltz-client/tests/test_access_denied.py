"""What the client does with ACCESS_DENIED (the cluster's ACL, ``waltz acl``), against
a scripted PROTOCOL TEST PEER: the refusal becomes ``PermissionDeniedError`` (of the
one hierarchy in ``waltz_api.errors``) carrying the partition, the permission and the
server's words, and nothing is retried. The real server's refusals are tested on real
processes in waltz-server's test_acl_processes.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from client_protocol_peer import ProtocolTestPeer
from client_support import Cluster, Ctx, RecordingApp, mount, other

from waltz_api.errors import PermissionDeniedError, ServerError, WaltzError
from waltz_api.messages import (
    AppendRequest,
    ErrorCode,
    ErrorResponse,
    FeedData,
    HighWaterMarkRequest,
    MountRequest,
    RangeReadRequest,
)
from waltz_client import AsyncWaltzClient

pytestmark = pytest.mark.timeout(60)

ANSWER = 10.0
"""Seconds within which the client reacts to a refusal (a loaded machine)."""
REFUSAL = (
    "access denied: partition 0 needs the write permission, and client key K holds read "
    "only; an operator grants it with `waltz acl grant --key K --partition 0 --permission "
    "write`"
)


@contextlib.asynccontextmanager
async def serving(
    cluster: Cluster, peer: ProtocolTestPeer, app: RecordingApp
) -> AsyncIterator[AsyncWaltzClient]:
    await cluster.assign(0, peer)
    client = AsyncWaltzClient(app, cluster.config(transport=peer.transport_name, partitions=[0]))
    await client.start()
    try:
        yield client
    finally:
        await client.close()


def denial(permission: str) -> str:
    return REFUSAL.replace("write", permission)


async def test_a_refused_append_fails_its_submission_alone_and_is_not_resent(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app) as client:
        conn, _ = await mount(peer, 0)
        ctx = Ctx()
        submitted = asyncio.ensure_future(client.submit(ctx))
        _, append = await peer.expect(AppendRequest)
        await conn.send(ErrorResponse(append.req_id, ErrorCode.ACCESS_DENIED, REFUSAL))
        with pytest.raises(PermissionDeniedError) as caught:
            await asyncio.wait_for(submitted, ANSWER)
        error = caught.value
        assert isinstance(error, ServerError) and isinstance(error, WaltzError)
        assert (error.partition_id, error.permission) == (0, "write")
        assert "partition 0" in str(error) and "waltz acl grant --key K" in str(error)
        assert len(ctx.hwms) == 1, "the context was not executed again"
        await peer.nothing_more(AppendRequest)
        await peer.nothing_more(MountRequest, 0.05)
        # the partition stays mounted: the feed goes on
        await conn.send(FeedData(other(0, 1), 0, 5))
        async with asyncio.timeout(ANSWER):
            while app.hwm.get(0) != 0:  # noqa: ASYNC110 - polls application state
                await asyncio.sleep(0.01)
        assert client.partitions[0].failure is None


async def test_a_refused_request_raises_at_once_and_is_not_retried(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app) as client:
        await mount(peer, 0)
        for kind, ask in [
            (HighWaterMarkRequest, lambda: client.high_water_mark(0)),
            (RangeReadRequest, lambda: client.range_read(0, 0)),
        ]:
            asked = asyncio.ensure_future(ask())
            conn, request = await peer.expect(kind)
            await conn.send(
                ErrorResponse(request.req_id, ErrorCode.ACCESS_DENIED, denial("read"))  # type: ignore[attr-defined]
            )
            with pytest.raises(PermissionDeniedError) as caught:
                await asyncio.wait_for(asked, ANSWER)
            assert (caught.value.partition_id, caught.value.permission) == (0, "read")
            await peer.nothing_more(kind)


async def test_a_refused_mount_stops_the_partition_without_retrying(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    app = RecordingApp()
    async with serving(cluster, peer, app) as client:
        waiting = asyncio.ensure_future(client.submit(Ctx()))
        conn, request = await peer.expect(MountRequest)
        await conn.send(ErrorResponse(request.req_id, ErrorCode.ACCESS_DENIED, denial("read")))
        with pytest.raises(PermissionDeniedError) as caught:
            await asyncio.wait_for(waiting, ANSWER)
        assert (caught.value.partition_id, caught.value.permission) == (0, "read")
        assert any(isinstance(e, PermissionDeniedError) for _, _, e in app.errors)
        with pytest.raises(PermissionDeniedError):
            await asyncio.wait_for(client.submit(Ctx()), ANSWER)
        await peer.nothing_more(MountRequest)
        await peer.nothing_more(AppendRequest, 0.05)
