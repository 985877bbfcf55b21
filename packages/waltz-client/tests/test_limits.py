"""Limits enforced at the edge: a transaction that cannot be sent fails ``submit`` at
once, naming the limit, and nothing reaches the server; a bad lock fails its builder."""

from __future__ import annotations

import asyncio

import pytest
from client_protocol_peer import ProtocolTestPeer
from client_support import Cluster, Ctx, RecordingApp, mount
from test_protocol import serving

from waltz_api import wire
from waltz_api.errors import InvalidArgumentError
from waltz_api.messages import AppendRequest
from waltz_api.types import MAX_LOCK_NAME_BYTES, MAX_LOCKS_PER_TRANSACTION, Lock, LockRequest, ReqId
from waltz_client import TransactionBuilder, TransactionTooLargeError
from waltz_client.api import APPEND_OVERHEAD

pytestmark = pytest.mark.timeout(60)


def test_the_append_overhead_is_the_codecs() -> None:
    for locks in ([], [Lock("a", 1)], [Lock("a", i) for i in range(7)]):
        request = LockRequest.from_locks(locks)
        frame = wire.encode(AppendRequest(ReqId(1, 2, 3, 4), 5, request, 6, b"xyz", 0))
        assert len(frame) == APPEND_OVERHEAD + 8 * len(locks) + 3
        builder = TransactionBuilder(0, -1).set_data(b"xyz")
        for lock in locks:
            builder.lock(lock)
        assert builder.wire_size == len(frame)


async def test_a_transaction_above_the_frame_limit_fails_submit_at_once(
    cluster: Cluster, peer: ProtocolTestPeer
) -> None:
    """Before: a payload above the 64 MiB frame limit made submit() hang (the frame was
    refused, the channel counted as lost, and the append retried forever)."""
    limit = 64 * 1024
    app = RecordingApp()
    async with serving(cluster, peer, app, transport_options={"max_frame_size": limit}) as client:
        await mount(peer, 0)
        too_big = Ctx(data=b"x" * limit)
        with pytest.raises(TransactionTooLargeError) as refused:
            await asyncio.wait_for(client.submit(too_big), 10)
        message = str(refused.value)
        assert f"max_frame_size of {limit} bytes" in message and f"{limit} bytes of data" in message
        assert too_big.attempts == 1
        assert [kind for kind, _ in too_big.events] == ["exception"]
        # nothing was sent; a transaction that fits goes through on the same connection
        fits = asyncio.ensure_future(client.submit(Ctx(data=b"y" * 100)))
        _, append = await peer.expect(AppendRequest)
        assert append.data == b"y" * 100
        fits.cancel()


def test_too_many_locks_fail_the_builder_naming_the_limit() -> None:
    builder = TransactionBuilder(0, -1)
    for i in range(MAX_LOCKS_PER_TRANSACTION):
        builder.write_lock("account", i)
    with pytest.raises(InvalidArgumentError, match=f"limit of {MAX_LOCKS_PER_TRANSACTION}"):
        builder.write_lock("account", -1)
    assert len(builder.locks) == MAX_LOCKS_PER_TRANSACTION


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("bad\ud800name", "character 3 ('\\ud800') cannot be encoded as UTF-8"),
        ("n" * 100_000, f"100000 UTF-8 bytes, above the limit of {MAX_LOCK_NAME_BYTES}"),
        ("é" * (MAX_LOCK_NAME_BYTES // 2 + 1), "above the limit"),
    ],
)
def test_a_bad_lock_name_fails_the_builder_with_what_is_wrong(name: str, says: str) -> None:
    with pytest.raises(InvalidArgumentError) as refused:
        TransactionBuilder(0, -1).write_lock(name, 1)
    assert says in str(refused.value)
    assert len(str(refused.value)) < 500  # the name is not echoed whole
