"""The server's AccessGate on the in-memory reference coordination: it follows the ACL
through changes and a lost session, refuses what a key lacks, fails closed on an ACL it
cannot read, and logs each refusal once a minute per key, partition and permission."""

from __future__ import annotations

import logging

import pytest

from waltz_api.access import ACL_PATH, AccessControl, Permission
from waltz_api.contracts.coordination import Coordination
from waltz_api.messages import AppendRequest, HighWaterMarkRequest, MountRequest
from waltz_api.types import LockRequest, ReqId
from waltz_conformance.reference.coordination import (
    MemoryCoordination,
    MemoryCoordinationService,
)
from waltz_conformance.suites.coordination import eventually
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.server.access import AccessGate

pytestmark = pytest.mark.timeout(60)

APPLIED = 10.0
"""Seconds within which the gate applies a change (in-memory coordination: far less)."""

KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
READ_0 = MountRequest(ReqId(1, 1, 0, 1), -1, 1)
READ_1 = HighWaterMarkRequest(ReqId(1, 1, 1, 2))
WRITE_0 = AppendRequest(ReqId(1, 1, 0, 3), -1, LockRequest(), 0, b"x", 0)


async def test_the_gate_follows_the_acl_through_a_lost_session(
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = MemoryCoordinationService()
    clients: list[MemoryCoordination] = []

    def new_client() -> Coordination:
        client = MemoryCoordination(service, "/waltz")
        clients.append(client)
        return client

    admin_client = MemoryCoordination(service, "/waltz")
    await admin_client.start()
    admin = ClusterAdmin(admin_client)
    await admin.create_cluster(num_partitions=2, num_replicas=1, storage_nodes=["h:1"])
    changes: list[AccessControl] = []
    gate = AccessGate(new_client, on_change=changes.append)
    await gate.start()
    try:
        assert gate.acl == AccessControl() and not gate.enforced
        assert gate.refusal(None, 0, WRITE_0) is None, "no ACL: everything is allowed"

        await admin.change_access_control(
            lambda acl: acl.granted(KEY, [0], Permission.READ).with_enforced(True)
        )
        await eventually(lambda: gate.enforced, APPLIED, "the gate sees the ACL enforced")
        assert changes and changes[-1].enforced
        assert gate.refusal(KEY, 0, READ_0) is None
        assert gate.may_read(KEY, 0) and not gate.may_read(KEY, 1)
        caplog.set_level(logging.WARNING, logger="waltz_server.server.access")
        for _ in range(5):
            refused = gate.refusal(KEY, 0, WRITE_0)
            assert refused is not None and "write permission" in refused
        refused = gate.refusal(KEY, 1, READ_1)
        assert refused is not None and "partition 1" in refused
        assert "plaintext" in (gate.refusal(None, 0, READ_0) or "")
        logged = [r.getMessage() for r in caplog.records if "refused a" in r.getMessage()]
        assert len(logged) == 3, logged  # one line per key, partition and permission

        # the gate's session is lost: it opens another and still follows the ACL
        service.expire_session(clients[0].session_id)
        await eventually(lambda: len(clients) >= 2, APPLIED, "the gate opens a new session")
        await admin.change_access_control(lambda acl: acl.granted(KEY, [1], Permission.WRITE))
        await eventually(
            lambda: gate.refusal(KEY, 1, WRITE_0) is None, APPLIED, "the new session's grant"
        )

        # an ACL this Waltz cannot read: every request is refused
        current = await admin_client.get(ACL_PATH)
        assert current is not None
        await admin_client.set(ACL_PATH, b'{"type":"acl","format":9}')
        await eventually(
            lambda: gate.refusal(KEY, 0, READ_0) is not None, APPLIED, "refusal on a bad ACL"
        )
        assert gate.acl == AccessControl(enforced=True)
    finally:
        await gate.close()
        await admin_client.close()


async def test_start_fails_when_the_acl_cannot_be_read() -> None:
    service = MemoryCoordinationService()
    service.kill()
    gate = AccessGate(lambda: MemoryCoordination(service, "/waltz"))
    with pytest.raises(Exception, match="could not be read within"):
        await gate.start(timeout=0.5)
