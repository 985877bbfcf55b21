"""The etcd plugin against a real secured etcd: HTTPS client URLs requiring client
certificates, authentication on, the cluster's user in a role that may read and write
its key prefix only. Certificates are made by the test (openssl)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from waltz_api.errors import (
    AuthenticationError,
    ConfigError,
    CoordinationError,
    CoordinationUnavailableError,
)
from waltz_conformance.servers.certs import CertFiles, TestPKI
from waltz_conformance.servers.etcd import EtcdAuth, EtcdCluster, EtcdTls
from waltz_conformance.suites.coordination import CoordinationHarness, CoordinationSuite
from waltz_coord_etcd import EtcdCoordination

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]

PASSWORD = "etcd-secret"
PREFIXES = ["/waltz-conformance/", "/waltz-secured/"]
TOKEN_TTL = 5
"""Seconds an etcd token lives here: the suite's clients outlive many tokens."""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPKI:
    return TestPKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secured_etcd(pki: TestPKI, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(
        tmp_path_factory.mktemp("etcd-secured"),
        size=1,
        tls=EtcdTls(pki.issue("etcd", server=True), pki.issue("etcd-admin", common_name=False)),
        auth=EtcdAuth("root-secret", {"waltz": (PASSWORD, PREFIXES)}, token_ttl=TOKEN_TTL),
    )
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def password_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secrets") / "etcd.password"
    path.write_text(PASSWORD + "\n")
    path.chmod(0o600)
    return path


def tls_options(client: CertFiles) -> dict[str, str]:
    return {"tls_ca": str(client.ca), "tls_cert": str(client.cert), "tls_key": str(client.key)}


def waltz_options(pki: TestPKI, password_file: Path) -> dict[str, str]:
    return {
        **tls_options(pki.issue("waltz-node", common_name=False)),
        "username": "waltz",
        "password_file": str(password_file),
    }


@pytest.mark.system
class TestSecuredEtcdCoordination(CoordinationSuite):
    """The whole coordination suite over TLS (client certificates) as the user whose
    role covers the suite's prefix, with tokens that expire every few seconds."""

    @pytest.fixture
    def harness(
        self, secured_etcd: EtcdCluster, pki: TestPKI, password_file: Path
    ) -> CoordinationHarness:
        from waltz_coord_etcd.conformance import harness as conformance_harness

        secured_etcd.ensure_all_running()
        return conformance_harness(
            {
                "cluster": secured_etcd,
                "session_timeout": 10.0,
                "client_options": waltz_options(pki, password_file),
            }
        )


def root(under: str = "/waltz-secured") -> str:
    return f"{under}/{uuid.uuid4().hex[:10]}"


async def test_the_users_role_limits_it_to_the_clusters_prefix(
    secured_etcd: EtcdCluster, pki: TestPKI, password_file: Path
) -> None:
    inside = EtcdCoordination(secured_etcd.uri(root(), waltz_options(pki, password_file)))
    outside = EtcdCoordination(
        secured_etcd.uri(root("/elsewhere"), waltz_options(pki, password_file))
    )
    await inside.start()
    try:
        version = await inside.create("/partitions/0", b"assignment")
        await inside.set("/partitions/0", b"moved", expected_version=version)
        # a root outside the role's prefix: refused at start (its first read)
        with pytest.raises(CoordinationError, match="permission denied; the user's role"):
            await outside.start()
    finally:
        await inside.close()
        await outside.close()


async def test_an_expired_token_is_renewed_without_the_caller_noticing(
    secured_etcd: EtcdCluster, pki: TestPKI, password_file: Path
) -> None:
    client = EtcdCoordination(secured_etcd.uri(root(), waltz_options(pki, password_file)))
    await client.start()
    try:
        version = await client.create("/value", b"1")
        first_token = client._gateway._token
        await asyncio.sleep(TOKEN_TTL + 2)  # the token expires meanwhile (the condition)
        version = await client.set(
            "/value", b"2", expected_version=version
        )  # a CAS: not idempotent
        value = await client.get("/value")
        assert value is not None and (value.value, value.version) == (b"2", version)
        assert client._gateway._token != first_token
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("case", "error", "says"),
    [
        ("wrong-password", AuthenticationError, "etcd refused the login of user 'waltz'"),
        ("no-login", CoordinationError, "requires authentication"),
        ("plaintext", CoordinationUnavailableError, "TLS: set tls=true"),
        ("wrong-ca", CoordinationUnavailableError, "TLS handshake with etcd"),
        ("no-client-cert", CoordinationUnavailableError, "etcd"),
        (
            "cert-with-cn",
            CoordinationError,
            "takes no client certificate that carries a CommonName",
        ),
    ],
)
async def test_a_client_without_the_right_credentials_is_told_why(
    secured_etcd: EtcdCluster,
    *,
    pki: TestPKI,
    password_file: Path,
    tmp_path: Path,
    case: str,
    error: type[Exception],
    says: str,
) -> None:
    options = waltz_options(pki, password_file)
    if case == "wrong-password":
        bad = tmp_path / "bad.password"
        bad.write_text("guess\n")
        options["password_file"] = str(bad)
    elif case == "no-login":
        options = tls_options(pki.issue("waltz-node", common_name=False))
    elif case == "plaintext":
        options = {"username": "waltz", "password_file": str(password_file)}
    elif case == "cert-with-cn":
        options.update(tls_options(pki.issue("named-node")))
    elif case == "wrong-ca":
        options["tls_ca"] = str(TestPKI(tmp_path / "other-ca").ca_cert)
    else:
        options = {
            "tls_ca": options["tls_ca"],
            "username": "waltz",
            "password_file": str(password_file),
        }
    client = EtcdCoordination(
        secured_etcd.uri(root(), options), {"request_timeout": 3, "connect_timeout": 1}
    )
    with pytest.raises(error) as refused:
        await asyncio.wait_for(client.start(), 60)
    await client.close()
    assert says in str(refused.value)


@pytest.mark.parametrize(
    ("uri", "options", "says"),
    [
        ("etcd://h:1/w?colour=blue", {}, "unknown etcd coordination option(s) colour"),
        ("etcd://h:1/w", {"tls_cert": "/nonexistent.crt"}, "not a readable file"),
        ("etcd://h:1/w?password=x", {}, "a coordination password is set but no username"),
        ("etcd://h:1/w?username=w", {}, "needs a password"),
    ],
)
def test_options_are_validated(uri: str, options: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError) as refused:
        EtcdCoordination(uri, options)
    assert says in str(refused.value)


def test_options_come_from_the_uri_query() -> None:
    client = EtcdCoordination("etcd://h:1/w?session_timeout=3&username=u&password=p")
    assert client.target.root == "/w" and client.target.endpoints == ("http://h:1",)
    assert client.login is not None and client.login.username == "u"
    assert "p" not in repr(client.login)


def test_the_cli_creates_a_cluster_on_the_secured_etcd(
    secured_etcd: EtcdCluster, pki: TestPKI, password_file: Path
) -> None:
    uri = secured_etcd.uri(root(), waltz_options(pki, password_file))
    done = subprocess.run(
        [sys.executable, "-m", "waltz_server.cli", "cluster", "create", "--coordination", uri,
         "--partitions", "2", "--replicas", "1", "--storage", "st1:5500"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shown = subprocess.run(
        [sys.executable, "-m", "waltz_server.cli", "cluster", "show", "--coordination", uri],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert PASSWORD not in done.stdout + done.stderr + shown.stdout + shown.stderr
