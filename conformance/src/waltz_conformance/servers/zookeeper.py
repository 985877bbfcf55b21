"""A real ZooKeeper (the Debian ``zookeeper`` package, 3.8), standalone, for tests.

The server runs ``org.apache.zookeeper.server.ZooKeeperServerMain`` from
``/usr/share/java/zookeeper.jar`` (whose manifest names the other jars it
needs under /usr/share/java) in a temp directory, on a free loopback port,
with the four-letter-word commands kazoo uses enabled and the admin HTTP
server off. It can be killed (-9) and restarted on the same port with its
data, so sessions survive a short outage as they do in production. ``host`` and
``wrap`` run it elsewhere than loopback: ``waltz chaos`` listens on an address of
a network namespace and wraps the command in ``ip netns exec``.

Secured (``tls=ZooKeeperTls(...)``, ``sasl_users={...}``): the only client port is
a TLS port (Netty; PEM key and trust stores; client certificates required), and
SASL DIGEST-MD5 logins are checked against the given users (a JAAS file). The
digest scheme (``addauth digest``) needs no server setting.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import urlencode

from waltz_api.errors import ProcessStartError
from waltz_api.supervised import SupervisedProcess
from waltz_conformance.servers import free_port
from waltz_conformance.servers.certs import CertFiles

log = logging.getLogger(__name__)

ZOOKEEPER_JAR = Path(os.environ.get("WALTZ_ZOOKEEPER_JAR", "/usr/share/java/zookeeper.jar"))
SLF4J_BINDING = Path("/usr/share/java/slf4j-simple.jar")
NETTY_JARS = [
    Path(f"/usr/share/java/netty-{name}.jar")
    for name in ("codec", "resolver", "transport-native-unix-common")
]
"""Netty jars the TLS port needs that zookeeper.jar's manifest does not name (Debian)."""
MAIN_CLASS = "org.apache.zookeeper.server.ZooKeeperServerMain"
HOST = "127.0.0.1"
PORT_ATTEMPTS = 3


class ZooKeeperUnavailableError(RuntimeError):
    """ZooKeeper or Java is not installed, or the server did not start (``port_taken``:
    because its port was in use)."""

    def __init__(self, message: str, *, port_taken: bool = False) -> None:
        super().__init__(message)
        self.port_taken = port_taken


@dataclass(frozen=True)
class ZooKeeperTls:
    """A TLS-only ZooKeeper: its certificate (whose CA it trusts for clients too) and a
    client certificate for the fixture's own health checks."""

    server: CertFiles
    client: CertFiles
    client_auth: str = "need"

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.server.ca))
        context.load_cert_chain(str(self.client.cert), str(self.client.key))
        return context


def four_letter_word(
    port: int,
    command: str,
    host: str = HOST,
    timeout: float = 2.0,
    tls: ssl.SSLContext | None = None,
) -> str:
    """Send a four-letter-word command (``ruok``, ``srvr``, ``cons``...) and return the reply."""
    with socket.create_connection((host, port), timeout=timeout) as raw:
        sock = raw if tls is None else tls.wrap_socket(raw, server_hostname=host)
        sock.sendall(command.encode("ascii"))
        chunks: list[bytes] = []
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


class ZooKeeperServer:
    """One standalone ZooKeeper server process in a temp directory.

    ``tick_time_ms`` sets the session timeout bounds (2 to 120 ticks). Use as
    a context manager, or call :meth:`start` and :meth:`stop` (by pid). ``host``
    is the address it listens on (give ``port`` too when it is not a local
    address); ``wrap`` is put before the command (e.g. ``ip netns exec NAME``).
    """

    def __init__(
        self,
        workdir: Path | str | None = None,
        *,
        port: int | None = None,
        tick_time_ms: int = 500,
        heap_mb: int = 256,
        java: str | None = None,
        host: str = HOST,
        wrap: Sequence[str] = (),
        tls: ZooKeeperTls | None = None,
        sasl_users: Mapping[str, str] | None = None,
    ) -> None:
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="waltz-zk-")).resolve()
        self.host = host
        self.wrap = list(wrap)
        self.port = port or free_port(host)
        self.tick_time_ms = tick_time_ms
        self.heap_mb = heap_mb
        self.java = java or shutil.which("java") or "java"
        self.child: SupervisedProcess | None = None
        self._auto_port = port is None
        self._started_once = False
        self.tls = tls
        self.sasl_users = dict(sasl_users or {})

    # -- addresses --------------------------------------------------------------------

    @property
    def connect_string(self) -> str:
        return f"{self.host}:{self.port}"

    def uri(self, root: str = "/waltz", options: Mapping[str, str] | None = None) -> str:
        """The Waltz coordination URI of this server: ``zk://127.0.0.1:PORT/root``, with
        ``options`` as query parameters (``tls=true&tls_ca=...``)."""
        query = f"?{urlencode(dict(options))}" if options else ""
        return f"zk://{self.connect_string}/{root.strip('/')}{query}"

    @property
    def min_session_timeout(self) -> float:
        return 2 * self.tick_time_ms / 1000

    # -- lifecycle --------------------------------------------------------------------------

    def _write_config(self) -> Path:
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "zoo.cfg"
        if self.tls is None:
            ports = [f"clientPort={self.port}", f"clientPortAddress={self.host}"]
        else:
            ports = [
                f"secureClientPort={self.port}",
                f"secureClientPortAddress={self.host}",
                "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory",
                f"ssl.keyStore.location={self.tls.server.bundle}",
                "ssl.keyStore.type=PEM",
                f"ssl.trustStore.location={self.tls.server.ca}",
                "ssl.trustStore.type=PEM",
                f"ssl.clientAuth={self.tls.client_auth}",
            ]
        if self.sasl_users:
            ports.append(
                "authProvider.1=org.apache.zookeeper.server.auth.SASLAuthenticationProvider"
            )
        config.write_text(
            "\n".join(
                [
                    f"tickTime={self.tick_time_ms}",
                    f"dataDir={data}",
                    *ports,
                    "maxClientCnxns=0",
                    f"minSessionTimeout={2 * self.tick_time_ms}",
                    "maxSessionTimeout=120000",
                    "admin.enableServer=false",
                    "4lw.commands.whitelist=*",
                    "preAllocSize=4096",
                    "snapCount=100000",
                    "autopurge.snapRetainCount=3",
                    "",
                ]
            )
        )
        return config

    def _command(self, config: Path) -> list[str]:
        classpath = [str(ZOOKEEPER_JAR)]
        if SLF4J_BINDING.exists():
            classpath.append(str(SLF4J_BINDING))
        extra: list[str] = []
        if self.tls is not None:
            classpath += [str(jar) for jar in NETTY_JARS if jar.exists()]
            extra.append(
                "-Dzookeeper.serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory"
            )
        if self.sasl_users:
            jaas = self.workdir / "jaas.conf"
            users = "".join(
                f'\n    user_{name}="{password}"' for name, password in self.sasl_users.items()
            )
            jaas.write_text(
                "Server {\n    org.apache.zookeeper.server.auth.DigestLoginModule required"
                f"{users};\n}};\n"
            )
            jaas.chmod(0o600)
            extra.append(f"-Djava.security.auth.login.config={jaas}")
        return [
            *self.wrap,
            self.java,
            *extra,
            f"-Xmx{self.heap_mb}m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-Xshare:auto",
            "-Dzookeeper.admin.enableServer=false",
            "-Dzookeeper.4lw.commands.whitelist=*",
            "-Dorg.slf4j.simpleLogger.defaultLogLevel=info",
            "-Dorg.slf4j.simpleLogger.showDateTime=true",
            "-cp",
            ":".join(classpath),
            MAIN_CLASS,
            str(config),
        ]

    def start(self, timeout: float = 90.0) -> ZooKeeperServer:
        """Start the server and wait until it answers ``ruok`` with ``imok``."""
        if self.running:
            return self
        if not ZOOKEEPER_JAR.exists():
            raise ZooKeeperUnavailableError(
                f"{ZOOKEEPER_JAR} is missing: install the Debian package 'zookeeper' "
                "(apt-get install zookeeper), or set WALTZ_ZOOKEEPER_JAR"
            )
        if shutil.which(self.java) is None and not Path(self.java).exists():
            raise ZooKeeperUnavailableError(
                "java is missing: install a JRE (apt-get install openjdk-17-jre-headless)"
            )
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                self._spawn_and_wait(timeout)
                self._started_once = True
                return self
            except ZooKeeperUnavailableError as exc:
                if not (exc.port_taken and self._auto_port and not self._started_once):
                    raise
                if attempt == PORT_ATTEMPTS:
                    raise
                log.warning("port %d was taken; starting ZooKeeper on another one", self.port)
                self.port = free_port(self.host)
        raise AssertionError("unreachable")

    def _spawn_and_wait(self, timeout: float) -> None:
        config = self._write_config()
        self.child = child = SupervisedProcess(
            self._command(config),
            self.workdir / "zookeeper.log",
            name="ZooKeeper",
            cwd=self.workdir,
            new_session=True,
            kill_at_exit=True,
        )
        child.start()
        log.info("started ZooKeeper pid %d on %s", child.pid, self.connect_string)
        try:
            child.wait_ready_sync(
                self._serving,
                timeout=timeout,
                interval=0.1,
                waiting_for=f"ZooKeeper on {self.connect_string} to answer ruok",
            )
        except ProcessStartError as exc:
            port_taken = "Address already in use" in child.output()
            self.stop(kill=True)
            raise ZooKeeperUnavailableError(str(exc), port_taken=port_taken) from exc

    def _serving(self) -> bool:
        tls = None if self.tls is None else self.tls.client_context()
        try:
            if four_letter_word(self.port, "ruok", self.host, tls=tls) != "imok":
                return False
            # Make sure the server answering is ours, not another one on a reused port.
            conf = four_letter_word(self.port, "conf", self.host, tls=tls)
            return f"dataDir={self.workdir / 'data'}" in conf
        except OSError:
            return False

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return None if self.child is None else self.child.process

    @property
    def running(self) -> bool:
        return self.child is not None and self.child.running

    def kill(self) -> None:
        """Kill the server with SIGKILL (its data stays for :meth:`restart`)."""
        child, self.child = self.child, None
        if child is not None:
            child.kill()
            log.info("killed ZooKeeper pid %s", child.pid)

    def restart(self, timeout: float = 90.0) -> None:
        """Start the server again on the same port with the same data."""
        self.kill()
        self.start(timeout)

    def stop(self, *, kill: bool = False, timeout: float = 10.0) -> None:
        """Stop the server by its pid (SIGTERM, then SIGKILL after ``timeout`` seconds)."""
        child, self.child = self.child, None
        if child is None:
            return
        if kill:
            child.kill()
        else:
            child.terminate(timeout)

    def cleanup(self) -> None:
        """Stop the server and delete its temp directory (if this object made it)."""
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        path = self.workdir / "zookeeper.log"
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> ZooKeeperServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()
