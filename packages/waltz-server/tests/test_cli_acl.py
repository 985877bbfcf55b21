"""``waltz acl``: grants, revocations, enforcement and checks, with click's CliRunner on
the embedded ``local`` coordination (a real SQLite file). What servers do with the ACL
is tested on real processes in test_acl_processes.py."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from waltz_api.access import EVERY_PARTITION, Permission
from waltz_api.cluster import coordination_from_uri
from waltz_server.cli import main
from waltz_server.cluster_admin import ClusterAdmin
from waltz_transport_zmq.keys import generate_keypair

pytestmark = pytest.mark.timeout(120)


def waltz(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env, terminal_width=200)


def ok(*args: str) -> str:
    result = waltz(*args)
    assert result.exit_code == 0, (args, result.output, result.exception)
    return result.output


def fails(*args: str, code: int = 1) -> str:
    result = waltz(*args)
    assert result.exit_code == code, (args, result.output)
    if code == 1:
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return result.output


@pytest.fixture
def uri(tmp_path: Path) -> str:
    made = f"local://{tmp_path}/coordination?root=/acl-{uuid.uuid4().hex[:8]}"

    async def create() -> None:
        client = coordination_from_uri(made)
        await client.start()
        try:
            await ClusterAdmin(client).create_cluster(
                num_partitions=4, num_replicas=1, storage_nodes=["127.0.0.1:7001"]
            )
        finally:
            await client.close()

    asyncio.run(create())
    return made


async def _read_acl(uri: str) -> object:
    client = coordination_from_uri(uri)
    await client.start()
    try:
        stored = await ClusterAdmin(client).access_control()
        return None if stored is None else stored.value
    finally:
        await client.close()


def test_grant_check_enable_revoke_disable(uri: str, tmp_path: Path) -> None:
    app = generate_keypair(tmp_path / "keys", "app1")
    other = generate_keypair(tmp_path / "keys", "other")
    c = ("--coordination", uri)
    assert "no ACL: not enforced" in ok("acl", "list", *c)
    # grants before enforcement: nothing is refused yet, and the output says so
    said = ok(
        "acl", "grant", *c, "--key", str(app.public_file), "--partition", "all",
        "--permission", "read",
    )  # fmt: skip
    assert f"key {app.public_key} (app1) now holds all: read" in said
    assert "not enforced" in said
    # a key's name works as --key afterwards
    ok("acl", "grant", *c, "--key", "app1", "--partition", "2", "--permission", "write")
    check = ("acl", "check", *c, "--key", "app1", "--partition", "1", "--permission", "write")
    assert "the ACL is not enforced" in ok(*check)
    assert "enforced" in ok("acl", "enable", *c)
    assert "may NOT write partition 1 (it holds read)" in fails(*check, code=3)
    may = ok("acl", "check", *c, "--key", app.public_key, "--partition", "2",
             "--permission", "write", "-o", "json")  # fmt: skip
    assert json.loads(may) == {
        "key": app.public_key,
        "partition": 2,
        "permission": "write",
        "held": "write",
        "enforced": True,
        "allowed": True,
    }
    fails("acl", "check", *c, "--key", str(other.public_file), "--partition", "0",
          "--permission", "read", code=3)  # fmt: skip

    listed = json.loads(ok("acl", "list", *c, "-o", "json"))
    assert listed == {
        "exists": True,
        "enforced": True,
        "grants": [
            {"key": app.public_key, "name": "app1", "partition": "all", "permission": "read"},
            {"key": app.public_key, "name": "app1", "partition": 2, "permission": "write"},
        ],
    }
    table = ok("acl", "list", *c, "-o", "table")
    assert "PARTITION" in table
    # yes and no, not Python's True and False
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines() if line.strip()}
    assert rows["exists"] == ["yes"] and rows["enforced"] == ["yes"], table
    assert "True" not in table and "False" not in table

    # revoking one partition leaves the grant on all partitions, and says so
    said = ok("acl", "revoke", *c, "--key", "app1", "--partition", "2", "--permission", "write")
    assert "now holds 2: read, all: read" in said or "now holds all: read, 2: read" in said
    assert "its grant on all partitions (read) still applies" in said
    said = ok("acl", "revoke", *c, "--key", "app1")
    assert "holds no permission on any partition" in said
    acl = asyncio.run(_read_acl(uri))
    assert acl is not None and acl.keys == {} and acl.enforced  # type: ignore[attr-defined]
    enabled = waltz("acl", "enable", *c)
    assert "no key holds any permission" in enabled.output
    assert "not enforced" in ok("acl", "disable", *c)
    assert "not enforced (grants kept)" in ok("acl", "list", *c)


def test_refusals_are_one_line(uri: str, tmp_path: Path) -> None:
    c = ("--coordination", uri)
    key = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
    grant = ("acl", "grant", *c, "--key", key, "--permission", "read")
    assert "does not exist: the cluster has partitions 0..3" in fails(*grant, "--partition", "4")
    assert "neither a partition id nor 'all'" in fails(*grant, "--partition", "x")
    assert "not a client key" in fails(
        "acl", "grant", *c, "--key", "two words", "--partition", "0", "--permission", "read"
    )
    bad_file = tmp_path / "bad.key"
    bad_file.write_text("nothing here\n")
    assert "holds no CurveZMQ public key" in fails(
        "acl", "grant", *c, "--key", str(bad_file), "--partition", "0", "--permission", "read"
    )
    fails(*grant, "--partition", "0", "--permission", "root", code=2)
    fails("acl", "check", *c, "--key", key, "--permission", "read", code=2)  # no --partition
    assert "not 'all'" in fails(
        "acl", "check", *c, "--key", key, "--partition", "all", "--permission", "read"
    )
    missing = f"local://{tmp_path}/elsewhere?root=/none"
    assert "no Waltz cluster" in fails(
        "acl", "grant", "--coordination", missing, "--key", key, "--partition", "0",
        "--permission", "read",
    )  # fmt: skip
    # a key that is not a Curve key is accepted with a note (another transport's identity)
    noted = waltz(
        "acl", "grant", *c, "--key", "spiffe://example/app", "--partition", "0",
        "--permission", "admin",
    )  # fmt: skip
    assert noted.exit_code == 0 and "not a CurveZMQ public key" in noted.output
    acl = asyncio.run(_read_acl(uri))
    assert acl.permission("spiffe://example/app", 0) is Permission.ADMIN  # type: ignore[attr-defined]
    assert acl.permission("spiffe://example/app", EVERY_PARTITION) is None  # type: ignore[attr-defined]


def test_the_coordination_uri_comes_from_the_environment(uri: str) -> None:
    result = waltz("acl", "list", env={"WALTZ_COORDINATION": uri})
    assert result.exit_code == 0 and "no ACL" in result.output
    assert "WALTZ_COORDINATION" in ok("acl", "grant", "--help")
