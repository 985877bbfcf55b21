"""A real etcd cluster (Debian ``etcd-server``, ``/usr/bin/etcd``, v3.4) for tests.

:class:`EtcdCluster` starts N members (3 by default) on free loopback ports,
each in its own temp data dir, waits until the cluster has a leader and every
member is healthy, and stops every process it started by its pid (SIGKILL as a
last resort, and from ``atexit`` if a test run dies before its finaliser).
It can kill -9 a member and restart it on the same data dir, and revoke a
client's lease (a session expiry). ``host``, ``ports`` and ``wrap`` run it
elsewhere than loopback (``waltz chaos``: in a network namespace, the command
wrapped in ``ip netns exec``).

Tests use the session-scoped ``etcd_cluster`` fixture (the conformance pytest
plugin's, :mod:`waltz_conformance.servers.fixtures`), or the class directly; this
module does not import pytest.

Secured (``tls=EtcdTls(...)``, ``auth=EtcdAuth(...)``): the client URLs are HTTPS
and require client certificates (``--client-cert-auth``), and etcd's
authentication is enabled with a root user and the given users, each with a role
granting readwrite on its key prefixes only. The fixture's own requests (health,
lease revocation) go as root over TLS.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import logging
import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from waltz_api.ports import free_ports
from waltz_api.supervised import SupervisedProcess
from waltz_conformance.servers.certs import CertFiles

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
ETCD_BINARY_ENV = "WALTZ_ETCD_BINARY"

_live_clusters: set[EtcdCluster] = set()


def find_etcd_binary() -> str:
    """The etcd server binary: $WALTZ_ETCD_BINARY, else ``etcd`` on PATH, else /usr/bin/etcd."""
    candidate = os.environ.get(ETCD_BINARY_ENV) or shutil.which("etcd") or "/usr/bin/etcd"
    if not os.access(candidate, os.X_OK):
        raise RuntimeError(
            f"no etcd server binary at {candidate!r}: install it (Debian: apt-get install "
            f"etcd-server) or point {ETCD_BINARY_ENV} at one"
        )
    return candidate


@dataclass(frozen=True)
class EtcdTls:
    """HTTPS client URLs: the members' certificate (its CA is the one clients must
    present certificates of) and the fixture's own client certificate."""

    server: CertFiles
    client: CertFiles

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.server.ca))
        context.load_cert_chain(str(self.client.cert), str(self.client.key))
        return context


@dataclass(frozen=True)
class EtcdAuth:
    """etcd authentication: the root password, and users with the key prefixes their
    role may read and write (``{"waltz": ("secret", ["/waltz/"])}``)."""

    root_password: str
    users: Mapping[str, tuple[str, Sequence[str]]] = field(default_factory=dict)
    token_ttl: int = 300
    """Seconds a simple token lives (etcd's --auth-token-ttl)."""


def _prefix_end(prefix: bytes) -> bytes:
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@dataclass(eq=False)
class EtcdMember:
    """One member of an :class:`EtcdCluster`."""

    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    child: SupervisedProcess | None = field(default=None, repr=False)
    """The running member (None: not started, or stopped on purpose)."""
    host: str = HOST
    scheme: str = "http"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return None if self.child is None else self.child.process

    @property
    def running(self) -> bool:
        return self.child is not None and self.child.running


class EtcdCluster:
    """A real etcd cluster of ``size`` members on loopback ports under ``base_dir``
    (or on ``host``, with ``ports``: a client and a peer port per member, when it is
    not a local address; ``wrap`` is put before each member's command)."""

    def __init__(
        self,
        base_dir: Path,
        size: int = 3,
        *,
        binary: str | None = None,
        start_timeout: float = 60.0,
        host: str = HOST,
        ports: Sequence[int] | None = None,
        wrap: Sequence[str] = (),
        tls: EtcdTls | None = None,
        auth: EtcdAuth | None = None,
    ) -> None:
        if ports is not None and len(ports) != 2 * size:
            raise ValueError(f"{size} etcd members need {2 * size} ports, got {len(ports)}")
        self.base_dir = Path(base_dir)
        self.size = size
        self.binary = binary or find_etcd_binary()
        self.start_timeout = start_timeout
        self.host = host
        self.ports = None if ports is None else list(ports)
        self.wrap = list(wrap)
        self.token = f"waltz-test-{uuid.uuid4().hex[:12]}"
        self.members: list[EtcdMember] = []
        self.tls = tls
        self.auth = auth
        self._ssl = None if tls is None else tls.client_context()
        self._root_token: str | None = None
        self._auth_enabled = False

    # -- lifecycle ----------------------------------------------------------------

    def start(self, attempts: int = 3) -> None:
        """Start every member and wait until the cluster is healthy.

        A free port can be taken by someone else before etcd binds it: then the
        start is retried (``attempts`` times) on new ports with fresh data dirs."""
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(attempt)
                return
            except RuntimeError as exc:
                if attempt == attempts:
                    raise
                log.warning("etcd cluster start attempt %d failed (%s); retrying", attempt, exc)

    def _start_once(self, attempt: int) -> None:
        ports = self.ports or free_ports(2 * self.size, self.host)
        run_dir = self.base_dir if attempt == 1 else self.base_dir / f"attempt-{attempt}"
        self.token = f"waltz-test-{uuid.uuid4().hex[:12]}"
        self.members = [
            EtcdMember(
                name=f"m{i}",
                client_port=ports[2 * i],
                peer_port=ports[2 * i + 1],
                data_dir=run_dir / f"m{i}",
                log_path=run_dir / f"m{i}.log",
                host=self.host,
                scheme="https" if self.tls is not None else "http",
            )
            for i in range(self.size)
        ]
        _live_clusters.add(self)
        self._auth_enabled = False
        self._root_token = None
        try:
            for index in range(self.size):
                self._spawn(index, state="new")
            self.wait_healthy(self.start_timeout)
            if self.auth is not None:
                self._enable_auth(self.auth)
        except BaseException:
            self.stop()
            raise
        log.info("etcd cluster up: %s", ",".join(self.endpoints))

    def stop(self) -> None:
        """Stop every member by its pid (SIGTERM, then SIGKILL after 5 s)."""
        for member in self.members:
            self._terminate(member)
        _live_clusters.discard(self)

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, index: int, *, state: str) -> None:
        member = self.members[index]
        member.data_dir.mkdir(parents=True, exist_ok=True)
        member.log_path.parent.mkdir(parents=True, exist_ok=True)
        initial_cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        command = [
            *self.wrap,
            self.binary,
            f"--name={member.name}",
            f"--data-dir={member.data_dir}",
            f"--listen-client-urls={member.client_url}",
            f"--advertise-client-urls={member.client_url}",
            f"--listen-peer-urls={member.peer_url}",
            f"--initial-advertise-peer-urls={member.peer_url}",
            f"--initial-cluster={initial_cluster}",
            f"--initial-cluster-state={state}",
            f"--initial-cluster-token={self.token}",
            "--heartbeat-interval=100",
            "--election-timeout=1000",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        if self.tls is not None:
            command += [
                f"--cert-file={self.tls.server.cert}",
                f"--key-file={self.tls.server.key}",
                f"--trusted-ca-file={self.tls.server.ca}",
                "--client-cert-auth=true",
            ]
        if self.auth is not None:
            command += ["--auth-token=simple", f"--auth-token-ttl={self.auth.token_ttl}"]
        member.child = SupervisedProcess(
            command,
            member.log_path,
            name=f"etcd member {member.name}",
            env={k: v for k, v in os.environ.items() if not k.startswith("ETCD")},
            new_session=True,
            kill_at_exit=True,
        )
        member.child.start()

    def _terminate(self, member: EtcdMember, *, kill: bool = False) -> None:
        child, member.child = member.child, None  # stopped on purpose: wait_healthy skips it
        if child is None:
            return
        if kill:
            child.kill()
        else:
            child.terminate(5.0)

    # -- faults ----------------------------------------------------------------------

    def kill_member(self, index: int) -> None:
        """kill -9 member ``index`` and wait for it to be gone."""
        self._terminate(self.members[index], kill=True)
        log.info("killed etcd member %s", self.members[index].name)

    def restart_member(self, index: int, *, wait: bool = True) -> None:
        """Start member ``index`` again on its data dir (after kill_member)."""
        member = self.members[index]
        if member.running:
            raise RuntimeError(f"etcd member {member.name} is still running")
        self._spawn(index, state="existing")
        if wait:
            self.wait_healthy(self.start_timeout)

    def ensure_all_running(self) -> None:
        """Restart every member a test killed and wait until the cluster is healthy."""
        for index, member in enumerate(self.members):
            if not member.running:
                self._spawn(index, state="existing")
        self.wait_healthy(self.start_timeout)

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke the lease ``lease_id`` (a client's session): its keys are deleted."""
        answer = self.request("lease/revoke", {"ID": str(lease_id)})
        if "error" in answer:
            raise RuntimeError(f"etcd refused to revoke lease {lease_id:x}: {answer}")

    # -- inspection --------------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """``host:port`` of every member's client URL."""
        return [m.endpoint for m in self.members]

    def uri(self, root: str = "/waltz", options: Mapping[str, str] | None = None) -> str:
        """The ``etcd://`` connect URI of the whole cluster with key prefix ``root``, with
        ``options`` as query parameters (``tls_ca=...&username=...``)."""
        query = f"?{urlencode(dict(options))}" if options else ""
        return f"etcd://{','.join(self.endpoints)}/{root.strip('/')}{query}"

    def request(self, method: str, body: dict[str, Any], *, timeout: float = 5.0) -> Any:
        """POST to ``/v3/<method>`` of the first running member that answers (as root,
        over TLS, when the cluster is secured)."""
        last: BaseException | None = None
        for _ in range(2):
            for member in self.members:
                if not member.running:
                    continue
                try:
                    answer = self._post(f"{member.client_url}/v3/{method}", body, timeout)
                except (OSError, ValueError) as exc:
                    last = exc
                    continue
                if self._auth_enabled and "invalid auth token" in str(answer):
                    self._root_token = None  # expired: log in again
                    break
                return answer
            else:
                break
        raise RuntimeError(f"no etcd member answered {method}: {last!r}")

    def _post(self, url: str, body: dict[str, Any], timeout: float) -> Any:
        headers = {"Authorization": self._root_login()} if self._auth_enabled else {}
        return _post_json(url, body, timeout, self._ssl, headers)

    def _root_login(self) -> str:
        if self._root_token is None:
            assert self.auth is not None
            login = {"name": "root", "password": self.auth.root_password}
            self._root_token = str(self._admin("auth/authenticate", login)["token"])
        return self._root_token

    def _admin(self, method: str, body: dict[str, Any]) -> Any:
        """An administrative request to the first running member (no failover)."""
        for member in self.members:
            if not member.running:
                continue
            headers = {}
            if self._auth_enabled and method != "auth/authenticate":
                headers["Authorization"] = self._root_login()
            url = f"{member.client_url}/v3/{method}"
            answer = _post_json(url, body, 5.0, self._ssl, headers)
            if isinstance(answer, dict) and "error" in answer:
                raise RuntimeError(f"etcd refused {method}: {answer}")
            return answer
        raise RuntimeError("no etcd member is running")

    def _enable_auth(self, auth: EtcdAuth) -> None:
        """A root user, the users with roles limited to their key prefixes; auth on."""
        self._admin("auth/user/add", {"name": "root", "password": auth.root_password})
        self._admin("auth/user/grant", {"user": "root", "role": "root"})
        for name, (password, prefixes) in auth.users.items():
            self._admin("auth/user/add", {"name": name, "password": password})
            self._admin("auth/role/add", {"name": name})
            for prefix in prefixes:
                key = prefix.encode()
                permission = {
                    "permType": "READWRITE",
                    "key": _b64(key),
                    "range_end": _b64(_prefix_end(key)),
                }
                self._admin("auth/role/grant", {"name": name, "perm": permission})
            self._admin("auth/user/grant", {"user": name, "role": name})
        self._admin("auth/enable", {})
        self._auth_enabled = True

    def member_status(self, index: int, timeout: float = 2.0) -> dict[str, Any]:
        status = self._post(f"{self.members[index].client_url}/v3/maintenance/status", {}, timeout)
        if not isinstance(status, dict):
            raise ValueError(f"malformed status {status!r}")
        return status

    def leader_index(self) -> int:
        """The index of the current leader."""
        for index, member in enumerate(self.members):
            if not member.running:
                continue
            with contextlib.suppress(OSError, ValueError):
                status = self.member_status(index)
                if status.get("leader") and status.get("leader") == status["header"]["member_id"]:
                    return index
        raise RuntimeError("the etcd cluster has no leader")

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Wait until every running member is healthy and the cluster has a leader."""
        deadline = time.monotonic() + timeout
        problem = "not checked yet"
        while time.monotonic() < deadline:
            problem = ""
            for member in self.members:
                if member.child is None:
                    continue
                if not member.child.running:
                    raise RuntimeError(
                        f"etcd member {member.name} exited with {member.child.returncode}; "
                        f"see {member.log_path}:\n{_tail(member.log_path)}"
                    )
                try:
                    with urllib.request.urlopen(
                        f"{member.client_url}/health", timeout=2, context=self._ssl
                    ) as r:
                        health = json.loads(r.read())
                except (OSError, ValueError) as exc:
                    problem = f"{member.name}: {exc}"
                    break
                if str(health.get("health")) != "true":
                    problem = f"{member.name}: {health}"
                    break
            if not problem:
                return
            time.sleep(0.1)
        raise RuntimeError(f"etcd cluster not healthy after {timeout}s: {problem}")


def _post_json(
    url: str,
    body: dict[str, Any],
    timeout: float,
    context: ssl.SSLContext | None = None,
    headers: Mapping[str, str] | None = None,
) -> Any:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **dict(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read() or b"{}")


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@atexit.register
def _stop_leftover_clusters() -> None:
    for cluster in list(_live_clusters):
        cluster.stop()
