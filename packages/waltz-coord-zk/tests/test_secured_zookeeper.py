"""The zk plugin against a real secured ZooKeeper: a TLS-only client port (client
certificates required), digest and SASL logins, ACLs on Waltz's znodes.
Certificates are made by the test (``waltz_conformance.servers.certs``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from waltz_api.cluster import coordination_from_uri
from waltz_api.errors import (
    AuthenticationError,
    ConfigError,
    CoordinationError,
    CoordinationUnavailableError,
)
from waltz_conformance.servers.certs import CertFiles, TestPKI
from waltz_conformance.servers.zookeeper import ZooKeeperServer, ZooKeeperTls
from waltz_conformance.suites.coordination import CoordinationHarness, CoordinationSuite
from waltz_coord_zk import ZooKeeperCoordination
from waltz_coord_zk.coordination import create_zk_coordination

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]

SASL_PASSWORD = "sasl-secret"
DIGEST_PASSWORD = "digest-secret"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPKI:
    return TestPKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secured_zookeeper(
    pki: TestPKI, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ZooKeeperServer]:
    tls = ZooKeeperTls(pki.issue("zookeeper", server=True), pki.issue("zk-health"))
    server = ZooKeeperServer(
        tmp_path_factory.mktemp("zk-secured"), tls=tls, sasl_users={"waltz": SASL_PASSWORD}
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("secrets")
    files = {}
    for name, password in (("digest", DIGEST_PASSWORD), ("sasl", SASL_PASSWORD), ("bad", "no")):
        files[name] = base / f"{name}.password"
        files[name].write_text(password + "\n")
        files[name].chmod(0o600)
    return files


def tls_options(client: CertFiles) -> dict[str, str]:
    return {
        "tls": "true",
        "tls_ca": str(client.ca),
        "tls_cert": str(client.cert),
        "tls_key": str(client.key),
    }


def digest_options(pki: TestPKI, secrets: dict[str, Path], **extra: str) -> dict[str, str]:
    return {
        **tls_options(pki.issue("waltz-server")),
        "auth": "digest",
        "username": "waltz",
        "password_file": str(secrets["digest"]),
        **extra,
    }


@pytest.mark.system
class TestSecuredZooKeeperCoordination(CoordinationSuite):
    """The whole coordination suite over TLS with a digest login and world-read ACLs."""

    @pytest.fixture
    def harness(
        self, secured_zookeeper: ZooKeeperServer, pki: TestPKI, secrets: dict[str, Path]
    ) -> CoordinationHarness:
        from waltz_coord_zk.conformance import harness as conformance_harness

        return conformance_harness(
            {
                "server": secured_zookeeper,
                "session_timeout": 8.0,
                "client_options": digest_options(pki, secrets),
            }
        )


@pytest.fixture
def root() -> str:
    return f"/secured-{uuid.uuid4().hex[:12]}"


async def started(uri: str, options: dict[str, Any] | None = None) -> ZooKeeperCoordination:
    client = coordination_from_uri(uri, options)
    assert isinstance(client, ZooKeeperCoordination)
    await client.start()
    return client


async def test_znodes_get_the_clusters_acl_and_other_identities_only_read(
    secured_zookeeper: ZooKeeperServer, pki: TestPKI, secrets: dict[str, Path], root: str
) -> None:
    owner = await started(secured_zookeeper.uri(root, digest_options(pki, secrets)))
    stranger = await started(
        secured_zookeeper.uri(
            root, {**digest_options(pki, secrets), "password_file": str(secrets["bad"])}
        )
    )
    anonymous = await started(secured_zookeeper.uri(root, tls_options(pki.issue("anon"))))
    try:
        version = await owner.create("/partitions/0/assignment", b"gen 1")
        acls, _ = owner.kazoo_client.get_acls(f"{root}/partitions/0/assignment")
        assert [(a.id.scheme, a.acl_list) for a in acls] == [
            ("digest", ["ALL"]),
            ("world", ["READ"]),
        ]
        assert acls[0].id.id.startswith("waltz:")
        for other in (stranger, anonymous):
            value = await other.get("/partitions/0/assignment")
            assert value is not None and value.value == b"gen 1"  # world-read
            with pytest.raises(CoordinationError, match="ACL does not allow"):
                await other.set("/partitions/0/assignment", b"gen 99", expected_version=version)
            with pytest.raises(CoordinationError, match="ACL does not allow"):
                await other.delete("/partitions/0/assignment")
            with pytest.raises(CoordinationError, match="ACL does not allow"):
                await other.create("/partitions/0/intruder", b"x")
        still = await owner.get("/partitions/0/assignment")
        assert still is not None and (still.value, still.version) == (b"gen 1", version)
        await owner.set("/partitions/0/assignment", b"gen 2", expected_version=version)
    finally:
        for client in (owner, stranger, anonymous):
            await client.close()


async def test_private_acl_hides_the_znodes_from_other_identities(
    secured_zookeeper: ZooKeeperServer, pki: TestPKI, secrets: dict[str, Path], root: str
) -> None:
    owner = await started(secured_zookeeper.uri(root, digest_options(pki, secrets, acl="private")))
    anonymous = await started(secured_zookeeper.uri(root, tls_options(pki.issue("anon"))))
    try:
        await owner.create("/store/secret", b"metadata")
        with pytest.raises(CoordinationError, match="ACL does not allow"):
            await anonymous.get("/store/secret")
        value = await owner.get("/store/secret")
        assert value is not None and value.value == b"metadata"
    finally:
        await owner.close()
        await anonymous.close()


async def test_sasl_login_and_acl(
    secured_zookeeper: ZooKeeperServer, pki: TestPKI, secrets: dict[str, Path], root: str
) -> None:
    sasl = {
        **tls_options(pki.issue("waltz-server")),
        "auth": "sasl",
        "username": "waltz",
        "password_file": str(secrets["sasl"]),
    }
    owner = await started(secured_zookeeper.uri(root, sasl))
    try:
        await owner.create("/cluster", b"config")
        acls, _ = owner.kazoo_client.get_acls(f"{root}/cluster")
        assert (acls[0].id.scheme, acls[0].id.id, acls[0].acl_list) == ("sasl", "waltz", ["ALL"])
    finally:
        await owner.close()
    refused = create_zk_coordination(
        secured_zookeeper.uri(root, {**sasl, "password_file": str(secrets["bad"])}),
        {"connect_timeout": 5},
    )
    with pytest.raises(AuthenticationError, match="refused this client's login"):
        await asyncio.wait_for(refused.start(), 60)
    await refused.close()


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("plaintext", "the port speaks TLS: set tls=true"),
        ("no-client-cert", "TLS handshake failed"),
        ("wrong-ca", "CERTIFICATE_VERIFY_FAILED"),
    ],
)
async def test_a_client_that_does_not_speak_the_servers_tls_is_told_why(
    secured_zookeeper: ZooKeeperServer,
    *,
    pki: TestPKI,
    tmp_path: Path,
    root: str,
    case: str,
    says: str,
) -> None:
    client_cert = pki.issue("waltz-server")
    if case == "plaintext":
        options: dict[str, str] = {}
    elif case == "no-client-cert":
        options = {"tls": "true", "tls_ca": str(client_cert.ca)}
    else:
        other = TestPKI(tmp_path / "other-ca").issue("impostor")
        options = {**tls_options(client_cert), "tls_ca": str(other.ca)}
    client = create_zk_coordination(secured_zookeeper.uri(root, options), {"connect_timeout": 3})
    with pytest.raises(CoordinationUnavailableError) as refused:
        await asyncio.wait_for(client.start(), 60)
    await client.close()
    assert says in str(refused.value)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"tls_cert": "/nonexistent.crt"}, "not a readable file"),
        ({"color": "blue"}, "unknown zk coordination option(s) color"),
        ({"username": "waltz", "password": "x"}, "no auth scheme: add auth=digest"),
        ({"auth": "digest", "username": "waltz"}, "needs a password"),
        ({"auth": "kerberos", "username": "w", "password": "x"}, "auth must be one of digest"),
        ({"acl": "private"}, "there is none: set auth"),
        ({"auth": "digest", "username": "w", "password": "x", "acl": "all"}, "acl must be one"),
        ({"tls": "maybe"}, "tls must be true or false"),
        ({"tls": "false", "tls_ca": "/etc/hostname"}, "are set but tls is false"),
    ],
)
def test_security_options_are_validated(options: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError) as refused:
        create_zk_coordination("zk://127.0.0.1:1/waltz", options)
    assert says in str(refused.value)


def test_the_cli_creates_and_shows_a_cluster_on_the_secured_zookeeper(
    secured_zookeeper: ZooKeeperServer, pki: TestPKI, secrets: dict[str, Path]
) -> None:
    """What docs/operators.md's secured deployment does: every `waltz` command takes
    the secured URI (the password in a file, not in the URI)."""
    uri = secured_zookeeper.uri("/waltz-secured-cli", digest_options(pki, secrets))

    def waltz(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "waltz_server.cli", *args, "--coordination", uri],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    created = waltz(
        "cluster", "create", "--partitions", "2", "--replicas", "1", "--storage", "st1:5500"
    )
    assert created.returncode == 0, created.stderr
    shown = waltz("cluster", "show")
    assert shown.returncode == 0 and "partitions" in shown.stdout.lower(), shown.stderr
    assert DIGEST_PASSWORD not in created.stdout + created.stderr + shown.stdout + shown.stderr
