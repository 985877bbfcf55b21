"""The cluster feature level (waltz_api.features): its value in the coordination
metadata, ClusterAdmin's raise, and ``waltz cluster features`` against the embedded
``local`` coordination (storage nodes that do not answer: the positive path on real
processes is in test_feature_levels_processes.py)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from waltz_api import __version__
from waltz_api.cluster import (
    FEATURES_PATH,
    ServerInfo,
    decode_feature_level,
    decode_server,
    encode_feature_level,
    encode_server,
)
from waltz_api.errors import ConfigError, CoordinationError
from waltz_api.features import FEATURE_LEVELS, MAX_FEATURE_LEVEL, MIN_FEATURE_LEVEL
from waltz_api.ports import free_port
from waltz_conformance.reference.coordination import MemoryCoordination, MemoryCoordinationService
from waltz_server.cli import main
from waltz_server.cluster_admin import ClusterAdmin

pytestmark = pytest.mark.timeout(120)


def test_the_table_of_levels() -> None:
    assert [f.level for f in FEATURE_LEVELS] == list(range(1, MAX_FEATURE_LEVEL + 1))
    assert MIN_FEATURE_LEVEL == 1 and MAX_FEATURE_LEVEL == 3
    assert FEATURE_LEVELS[0].release == "0.1.0"
    docs = (Path(__file__).parents[3] / "docs" / "compatibility.md").read_text(encoding="utf-8")
    for feature in FEATURE_LEVELS:  # the docs' table names every level and what it enables
        assert f"| {feature.level} | {feature.release} |" in docs


def test_the_value_and_a_registration_without_a_level() -> None:
    assert decode_feature_level(encode_feature_level(2)) == 2
    raw = json.dumps({"format": 2, "type": "feature_level", "level": 2}).encode()
    with pytest.raises(CoordinationError, match="upgrade Waltz"):
        decode_feature_level(raw)
    with pytest.raises(CoordinationError, match="no valid feature level"):
        decode_feature_level(b'{"format": 1, "type": "feature_level", "level": 0}')
    # a registration of 0.1.0 has no level: 1
    old = b'{"format":1,"type":"server","server_id":3,"endpoint":"tcp://h:1"}'
    assert decode_server(old, "/servers/3").max_feature_level == 1
    info = ServerInfo(4, "tcp://h:2", (1,), 2)
    assert decode_server(encode_server(info), "/servers/4") == info


async def test_create_records_the_level_and_raise_only_raises() -> None:
    coordination = MemoryCoordination(MemoryCoordinationService(), "/f")
    await coordination.start()
    try:
        admin = ClusterAdmin(coordination)
        await admin.create_cluster(num_partitions=1, num_replicas=1, storage_nodes=["h:1"])
        assert (await admin.feature_level()).value == MAX_FEATURE_LEVEL
        # a cluster of 0.1.0 records none: level 1
        await coordination.delete(FEATURES_PATH)
        assert (await admin.feature_level()).value == 1
        assert (await admin.feature_level()).version == -1
        assert await admin.raise_feature_level(1) == (1, 1)  # nothing to do
        assert not await coordination.exists(FEATURES_PATH)
        assert await admin.raise_feature_level(2) == (1, 2)
        assert await admin.raise_feature_level(2) == (2, 2)  # idempotent
        with pytest.raises(ConfigError, match="never lowered"):
            await admin.raise_feature_level(1)
        with pytest.raises(ConfigError, match="not one this Waltz knows"):
            await admin.raise_feature_level(MAX_FEATURE_LEVEL + 1)
        assert (await admin.feature_level()).value == 2
        assert await admin.raise_feature_level(MAX_FEATURE_LEVEL) == (2, MAX_FEATURE_LEVEL)
        assert (await admin.feature_level()).value == MAX_FEATURE_LEVEL
    finally:
        await coordination.close()


@pytest.fixture
def uri(tmp_path: Path) -> str:
    return f"local://{tmp_path}?root=/c-{uuid.uuid4().hex[:8]}"


def create(uri: str, *extra: str) -> list[str]:
    nodes = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    args = ["cluster", "create", "--coordination", uri, "--partitions", "1", "--replicas", "2"]
    for node in nodes:
        args += ["--storage", node]
    done = CliRunner().invoke(main, [*args, *extra])
    assert done.exit_code == 0, done.output
    return nodes


def features(uri: str, *extra: str) -> tuple[int, str]:
    done = CliRunner().invoke(
        main, ["cluster", "features", "--coordination", uri, "--timeout", "2", *extra]
    )
    return done.exit_code, done.output


def test_create_at_level_1_and_show(uri: str) -> None:
    nodes = create(uri, "--feature-level", "1")
    code, out = features(uri, "-o", "json")
    assert code == 0, out
    found = json.loads(out)
    assert found["feature_level"] == 1 and found["max_feature_level"] == MAX_FEATURE_LEVEL
    assert [r["storage_node"] for r in found["storage_nodes"]] == sorted(nodes)
    assert all(r["error"] for r in found["storage_nodes"])  # nothing listens there
    assert found["servers"] == []
    code, out = features(uri)
    assert code == 0, out
    top = MAX_FEATURE_LEVEL
    assert f"cluster feature level: 1 (this Waltz, {__version__}, supports up to {top})" in out
    assert f"not raisable to {top} now: storage node {sorted(nodes)[0]} cannot be asked" in out


def test_raise_is_refused_while_a_storage_node_cannot_be_asked(uri: str) -> None:
    nodes = create(uri, "--feature-level", "1")
    code, out = features(uri, "--raise")
    assert code != 0
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out
    assert f"the feature level stays 1, not raised to {MAX_FEATURE_LEVEL}" in errors[0]
    assert all(f"storage node {node} cannot be asked" in errors[0] for node in nodes)
    code, out = features(uri, "-o", "json")
    assert json.loads(out)["feature_level"] == 1


def test_lowering_and_unknown_levels_are_refused(uri: str) -> None:
    create(uri)
    code, out = features(uri, "--to", "1")
    assert code != 0 and "never lowered" in out and "docs/compatibility.md" in out
    unknown = MAX_FEATURE_LEVEL + 1
    code, out = features(uri, "--to", str(unknown))
    assert code != 0 and f"feature level {unknown} is not one this Waltz knows" in out
    code, out = features(uri, "--raise", "--to", "2")
    assert code != 0 and "not both" in out
