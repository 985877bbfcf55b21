"""The compatibility policy (docs/compatibility.md), checked against fixtures
of the current formats.

- Wire protocol: the version 1 frames of
  ``packages/waltz-api/tests/data/wire_v1_vectors.txt`` decode and re-encode
  byte for byte, and a peer that offers only version 1 is answered in version 1.
- Coordination metadata layout: ``data/coordination_v1_layout.json`` is the
  tree a cluster's metadata occupies (paths and values) after a fixed scenario.
  The current code must read it, and must write exactly it: a change of the
  layout fails here, and needs a new metadata format number, a new fixture
  beside this one, and the old one kept as a read test.
- The on-disk format of the ``fs`` engine has its own fixture and test in
  waltz-storage-fs (its format version lives in the engine).

Regenerate the coordination fixture only for a deliberate, announced format
change: ``python packages/waltz-server/tests/test_compatibility.py``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

from waltz_api import wire
from waltz_api.access import EVERY_PARTITION, AccessControl, KeyGrants, Permission
from waltz_api.cluster import (
    FEATURES_PATH,
    FORMAT_VERSION,
    SERVERS_DIR,
    ArchiveMark,
    ClusterConfig,
    LeaderRecord,
    PartitionAssignment,
    ReplicaAssignments,
    ServerInfo,
)
from waltz_api.contracts.coordination import Coordination
from waltz_api.messages import Hello, HelloResponse
from waltz_api.types import UNRESOLVED, ReplicaId, ReplicaState
from waltz_conformance.reference.coordination import (
    MemoryCoordination,
    MemoryCoordinationService,
)
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.server.preferred import PreferredPartitionStore
from waltz_server.server.store_metadata import begin_store_session, update_replica_states

HERE = Path(__file__).resolve().parent
LAYOUT_V1 = HERE / "data" / "coordination_v1_layout.json"
WIRE_V1 = HERE.parents[1] / "waltz-api" / "tests" / "data" / "wire_v1_vectors.txt"
COUNTERS = ("/ids/server", "/ids/client")
"""Counter entries: their value is the plugin's own (a ZooKeeper data version, a
number in SQLite); the layout fixes only the path."""

CLUSTER_KEY = uuid.UUID("6f1c3d7e-0a4f-4c1e-9a51-3d2b8f6e7c90")
SERVER_ENDPOINT = "tcp://srv1.example.com:5600"
APP_KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
"""A client's CurveZMQ public key (Z85), as `waltz keys generate` writes it."""
ARCHIVE_MARK = ArchiveMark(
    0,
    999,
    "manifest/00000000000000000999-5e1f0c2a.json",
    2,
    1_234_567,
    "s3://waltz-archive/cluster-a",
)


# -- wire protocol ---------------------------------------------------------------------------------


def _wire_vectors() -> list[tuple[str, bytes]]:
    found = []
    for line in WIRE_V1.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            _, name, frame = line.split()
            found.append((name, bytes.fromhex(frame)))
    return found


def test_protocol_version_1_is_still_spoken() -> None:
    assert 1 in wire.SUPPORTED_VERSIONS
    vectors = _wire_vectors()
    assert len(vectors) >= 40
    for name, frame in vectors:
        message = wire.decode(frame)
        assert type(message).__name__ == name
        assert wire.encode(message) == frame, name


def test_a_version_1_peer_is_answered_in_version_1() -> None:
    acceptor = wire.ProtocolConnection(wire.Role.ACCEPTOR, sender="server:1")
    acceptor.receive_frame(wire.encode(Hello((1,), "client:7")))
    frame = acceptor.send(acceptor.hello_response())
    assert wire.decode(frame) == HelloResponse(1)
    assert acceptor.state is wire.ConnectionState.OPEN

    initiator = wire.ProtocolConnection(wire.Role.INITIATOR, sender="client:7")
    hello = wire.decode(initiator.start_handshake())
    assert isinstance(hello, Hello) and 1 in hello.versions
    initiator.receive_frame(wire.encode(HelloResponse(1)))
    assert initiator.version == 1


# -- coordination metadata layout ------------------------------------------------------------------


FIXTURE_LEVEL = 2
"""The feature level the fixture's scenario runs at (the level it was recorded at; the
layout does not depend on it)."""


async def _write_scenario(coordination: Coordination) -> None:
    """The fixed scenario: create, a server registers, claims the leadership and is
    assigned a partition, which opens a store session and records its replicas'
    states; an operator pins a partition to another server."""
    cluster = ClusterAdmin(coordination)
    await cluster.create_cluster(
        num_partitions=2,
        num_replicas=2,
        storage_nodes=["st1:5500", "st2:5500"],
        cluster_key=CLUSTER_KEY,
        feature_level=FIXTURE_LEVEL,
    )
    server_id = await cluster.allocate_server_id()
    await cluster.register_server(
        server_id, SERVER_ENDPOINT, preferred_partitions=[1], max_feature_level=FIXTURE_LEVEL
    )
    await cluster.claim_leadership(server_id)
    current = await cluster.partition_assignment(0)
    await cluster.assign_partition(0, server_id, SERVER_ENDPOINT, expected_version=current.version)
    stored = await begin_store_session(coordination, 0, 1)
    await update_replica_states(
        coordination,
        stored,
        {
            "st1:5500": ReplicaState(ReplicaId(0, "st1:5500"), stored.value.session_id, 41),
            "st2:5500": ReplicaState(ReplicaId(0, "st2:5500"), -1, UNRESOLVED),
        },
    )
    await cluster.allocate_client_id()
    await PreferredPartitionStore(coordination).change("tcp://srv2.example.com:5600", lambda _: [0])
    # partition 0 archived ids 0..999 in two ranges (tiered storage, docs/archive.md)
    await cluster.advance_archive_mark(await cluster.archive_mark(0), ARCHIVE_MARK)
    # an operator grants a client key read everywhere and write on partition 1, then
    # enforces the ACL (`waltz acl grant`, `waltz acl enable`)
    await cluster.change_access_control(
        lambda acl: (
            acl.granted(APP_KEY, [EVERY_PARTITION], Permission.READ, name="app1")
            .granted(APP_KEY, [1], Permission.WRITE)
            .with_enforced(True)
        )
    )


async def _dump(coordination: Coordination) -> dict[str, Any]:
    tree: dict[str, Any] = {}

    async def walk(path: str) -> None:
        for child in sorted(await coordination.children(path)):
            full = f"{path.rstrip('/')}/{child}"
            found = await coordination.get(full)
            if full in COUNTERS:
                tree[full] = None
            elif found is not None and found.value:
                tree[full] = json.loads(found.value)
            await walk(full)

    await walk("/")
    return tree


async def _started() -> MemoryCoordination:
    coordination = MemoryCoordination(MemoryCoordinationService(), "/waltz")
    await coordination.start()
    return coordination


async def test_the_current_code_writes_the_version_1_layout() -> None:
    coordination = await _started()
    try:
        await _write_scenario(coordination)
        written = await _dump(coordination)
    finally:
        await coordination.close()
    fixture = json.loads(LAYOUT_V1.read_text(encoding="utf-8"))
    assert fixture["format"] == FORMAT_VERSION, (
        "the metadata format number changed: add a fixture of the new format and keep "
        "this one as a read test (docs/compatibility.md)"
    )
    assert written == fixture["tree"], (
        "the coordination metadata layout changed: a cluster created by an older release "
        "would be read differently (docs/compatibility.md)"
    )


async def test_the_current_code_reads_the_version_1_layout() -> None:
    fixture = json.loads(LAYOUT_V1.read_text(encoding="utf-8"))
    coordination = await _started()
    try:
        for path, value in fixture["tree"].items():
            raw = b"" if value is None else json.dumps(value).encode()
            await coordination.create(path, raw)
        cluster = ClusterAdmin(coordination)
        assert await cluster.config() == ClusterConfig(CLUSTER_KEY, 2, 2)
        assignments = await cluster.replica_assignments()
        assert assignments == ReplicaAssignments(2, {"st1:5500": (0, 1), "st2:5500": (0, 1)}, {})
        assert await cluster.servers() == [ServerInfo(1, SERVER_ENDPOINT, (1,), 2)]
        assert (await cluster.feature_level()).value == 2
        assert (await cluster.leader()).value == LeaderRecord(1, 1, 0)  # type: ignore[union-attr]
        assert (await cluster.partition_assignment(0)).value == PartitionAssignment(
            0, 1, SERVER_ENDPOINT, 1
        )
        assert (await cluster.partition_assignment(1)).value == PartitionAssignment(1)
        store = (await cluster.store_metadata(0)).value
        assert (store.partition_id, store.generation, store.session_id) == (0, 1, 0)
        assert {
            r.replica_id.storage_node: (r.session_id, r.closing_high_water_mark)
            for r in store.replicas
        } == {"st1:5500": (0, 41), "st2:5500": (-1, UNRESOLVED)}
        assert (await cluster.archive_mark(0)).value == ARCHIVE_MARK
        assert (await cluster.archive_mark(1)).value == ArchiveMark(1)  # none: -1
        overrides = await PreferredPartitionStore(coordination).read()
        assert overrides.endpoints == {"tcp://srv2.example.com:5600": (0,)}
        acl = await cluster.access_control()
        assert acl is not None
        assert acl.value == AccessControl(
            True,
            {APP_KEY: KeyGrants({EVERY_PARTITION: Permission.READ, 1: Permission.WRITE}, "app1")},
        )
    finally:
        await coordination.close()


async def test_a_layout_without_a_feature_level_is_at_level_1() -> None:
    """Clusters created by 0.1.0 record no feature level, and its servers register none:
    level 1 (waltz_api.features)."""
    fixture = json.loads(LAYOUT_V1.read_text(encoding="utf-8"))
    coordination = await _started()
    try:
        for path, value in fixture["tree"].items():
            if path == FEATURES_PATH:
                continue
            old = value
            if path.startswith(SERVERS_DIR + "/"):
                old = {k: v for k, v in value.items() if k != "max_feature_level"}
            raw = b"" if old is None else json.dumps(old).encode()
            await coordination.create(path, raw)
        cluster = ClusterAdmin(coordination)
        assert (await cluster.feature_level()).value == 1
        assert await cluster.servers() == [ServerInfo(1, SERVER_ENDPOINT, (1,), 1)]
    finally:
        await coordination.close()


async def test_a_layout_without_an_acl_enforces_nothing() -> None:
    """Clusters created before ACLs existed have no /acl: every key may do everything."""
    fixture = json.loads(LAYOUT_V1.read_text(encoding="utf-8"))
    coordination = await _started()
    try:
        for path, value in fixture["tree"].items():
            if path != "/acl":
                raw = b"" if value is None else json.dumps(value).encode()
                await coordination.create(path, raw)
        cluster = ClusterAdmin(coordination)
        assert await cluster.access_control() is None
        seen: list[AccessControl | None] = []
        called = asyncio.Event()

        def on_acl(acl: AccessControl | None) -> None:
            seen.append(acl)
            called.set()

        watch = await cluster.watch_access_control(on_acl)
        await asyncio.wait_for(called.wait(), 10)
        watch.cancel()
        assert seen == [None]
    finally:
        await coordination.close()


async def _regenerate() -> None:
    coordination = await _started()
    try:
        await _write_scenario(coordination)
        tree = await _dump(coordination)
    finally:
        await coordination.close()
    LAYOUT_V1.parent.mkdir(exist_ok=True)
    LAYOUT_V1.write_text(
        json.dumps({"format": FORMAT_VERSION, "tree": tree}, indent=2, sort_keys=True) + "\n",
        encoding="utf-8",
    )


if __name__ == "__main__":
    asyncio.run(_regenerate())
