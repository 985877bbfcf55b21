"""The ACL model (waltz_api.access): permissions, grants and revocations, the codec."""

from __future__ import annotations

from pathlib import Path

import pytest

from waltz_api.access import (
    EVERY_PARTITION,
    AccessControl,
    KeyGrants,
    Permission,
    check_identity,
    decode_access_control,
    denial,
    describe,
    encode_access_control,
    is_curve_key,
    needed_for,
    parse_partition,
    read_key_file,
)
from waltz_api.errors import ConfigError, CoordinationError
from waltz_api.messages import (
    AppendRequest,
    FeedRequest,
    FlushRequest,
    HighWaterMarkRequest,
    MountRequest,
    RangeReadRequest,
    TransactionDataRequest,
)
from waltz_api.types import LockRequest, ReqId

ALICE = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
BOB = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"
READ, WRITE, ADMIN = Permission.READ, Permission.WRITE, Permission.ADMIN


def test_not_enforced_allows_everyone_and_enforced_denies_by_default() -> None:
    open_acl = AccessControl().granted(ALICE, [0], READ)
    assert open_acl.allows(BOB, 0, ADMIN) and open_acl.allows(None, 3, WRITE)
    acl = open_acl.with_enforced(True)
    assert acl.allows(ALICE, 0, READ)
    assert not acl.allows(ALICE, 0, WRITE)
    assert not acl.allows(ALICE, 1, READ)
    assert not acl.allows(BOB, 0, READ)
    assert not acl.allows(None, 0, READ), "a plaintext connection is served nothing"


def test_a_permission_includes_the_ones_below_and_every_partition_grants_combine() -> None:
    acl = (
        AccessControl(enforced=True)
        .granted(ALICE, [EVERY_PARTITION], READ)
        .granted(ALICE, [2], ADMIN)
        .granted(BOB, [1], WRITE)
    )
    assert acl.permission(ALICE, 7) is READ
    assert acl.permission(ALICE, 2) is ADMIN
    assert acl.allows(ALICE, 2, WRITE) and acl.allows(ALICE, 2, READ)
    assert acl.allows(BOB, 1, READ) and acl.allows(BOB, 1, WRITE)
    assert not acl.allows(BOB, 1, ADMIN)
    # a grant never lowers what is held there
    assert acl.granted(ALICE, [2], READ).permission(ALICE, 2) is ADMIN


def test_revoke_lowers_below_the_permission_or_removes() -> None:
    acl = AccessControl(enforced=True).granted(ALICE, [0, 1], ADMIN).granted(ALICE, [2], READ)
    lowered = acl.revoked(ALICE, [0], WRITE)
    assert lowered.permission(ALICE, 0) is READ
    assert lowered.permission(ALICE, 1) is ADMIN
    assert acl.revoked(ALICE, None, WRITE).keys[ALICE].partitions == {0: READ, 1: READ, 2: READ}
    assert acl.revoked(ALICE, None, READ).keys == {}, "no grant left: the key is gone"
    assert acl.revoked(ALICE, [1]).keys[ALICE].partitions == {0: ADMIN, 2: READ}
    assert acl.revoked(ALICE).keys == {}
    assert acl.revoked(BOB) == acl
    assert acl.revoked(ALICE, [2], WRITE) == acl, "read is below write: nothing to revoke"


def test_the_codec_round_trips_and_refuses_what_it_cannot_read() -> None:
    acl = (
        AccessControl(enforced=True)
        .granted(ALICE, [EVERY_PARTITION], READ, name="app1")
        .granted(BOB, [3], WRITE)
    )
    raw = encode_access_control(acl)
    assert decode_access_control(raw) == acl
    assert b'"all":"read"' in raw
    assert decode_access_control(encode_access_control(AccessControl())) == AccessControl()
    for bad in (
        b"not json",
        b"[]",
        b'{"type":"leader"}',
        b'{"format":2,"type":"acl"}',
        b'{"type":"acl","enforced":"yes"}',
        b'{"type":"acl","keys":{"has space":{}}}',
        b'{"type":"acl","keys":{"k":{"partitions":{"0":"root"}}}}',
        b'{"type":"acl","keys":{"k":{"partitions":{"-3":"read"}}}}',
        b'{"type":"acl","keys":{"k":[1]}}',
    ):
        with pytest.raises(CoordinationError):
            decode_access_control(bad)


def test_identities_partitions_and_key_files(tmp_path: Path) -> None:
    assert check_identity(ALICE) == ALICE and is_curve_key(ALICE)
    assert not is_curve_key("app1")
    for bad in ("", "two words", "x" * 257, "new\nline"):
        with pytest.raises(ConfigError):
            check_identity(bad)
    assert parse_partition("all") == EVERY_PARTITION and parse_partition("4") == 4
    for bad_partition in ("-1", "x"):
        with pytest.raises(ConfigError):
            parse_partition(bad_partition)
    with pytest.raises(ConfigError, match="read, write or admin"):
        Permission.parse("owner")
    key_file = tmp_path / "app1.key"
    key_file.write_text(f'metadata\ncurve\n    public-key = "{ALICE}"\n')
    assert read_key_file(key_file) == ALICE
    (tmp_path / "bad.key").write_text("curve\n")
    with pytest.raises(ConfigError, match="no CurveZMQ public key"):
        read_key_file(tmp_path / "bad.key")
    with pytest.raises(ConfigError, match="cannot read"):
        read_key_file(tmp_path / "missing.key")


def test_what_each_request_needs_and_what_a_refusal_says() -> None:
    req = ReqId(1, 1, 3, 1)
    assert needed_for(AppendRequest(req, -1, LockRequest(), 0, b"", 0)) is WRITE
    for read in (
        MountRequest(req, -1, 1),
        FeedRequest(req, -1),
        TransactionDataRequest(req, 0),
        RangeReadRequest(req, 0, 10, 100),
        HighWaterMarkRequest(req),
        FlushRequest(req),
    ):
        assert needed_for(read) is READ
    acl = AccessControl(enforced=True).granted(ALICE, [3], READ)
    said = denial(ALICE, 3, WRITE, acl)
    assert "partition 3" in said and "write" in said and ALICE in said and "holds read only" in said
    assert "plaintext" in denial(None, 3, READ, acl)
    assert describe(None) == {"exists": False, "enforced": False, "grants": []}
    assert describe(acl)["grants"] == [
        {"key": ALICE, "name": "", "partition": 3, "permission": "read"}
    ]
    assert KeyGrants().partitions == {}
