"""Throw-away certificates for tests of secured servers (TLS), made with ``openssl``.

:class:`TestPKI` creates a certificate authority in a directory and issues
certificates signed by it: a server's (subject alternative names 127.0.0.1 and
localhost, usable for server and client authentication) or a client's (its common
name is the identity, e.g. an etcd user). Keys are RSA 2048 in PKCS#8 PEM, which
Python's ``ssl``, Go (etcd) and Java (ZooKeeper's PEM key stores) all read. Valid
for two days; nothing outside the directory is touched.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

VALID_DAYS = 2


@dataclass(frozen=True)
class CertFiles:
    """A certificate and its key (PEM files), and the CA that signed it."""

    cert: Path
    key: Path
    ca: Path

    @property
    def bundle(self) -> Path:
        """Key and certificate in one PEM file (ZooKeeper's PEM key store), made on demand."""
        path = self.cert.with_suffix(".pem")
        if not path.exists():
            path.write_bytes(self.key.read_bytes() + self.cert.read_bytes())
            path.chmod(0o600)
        return path


class TestPKI:
    """A certificate authority in ``directory`` (created on first use)."""

    __test__ = False  # not a pytest test class

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.ca_cert = self.directory / "ca.crt"
        self.ca_key = self.directory / "ca.key"
        openssl = shutil.which("openssl")
        if openssl is None:
            raise RuntimeError("openssl is missing: install it (apt-get install openssl)")
        self._openssl = openssl
        if not self.ca_cert.exists():
            self.directory.mkdir(parents=True, exist_ok=True)
            self._run(
                "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                "-keyout", self.ca_key, "-out", self.ca_cert, "-days", VALID_DAYS,
                "-subj", "/CN=waltz-test-ca",
                "-addext", "basicConstraints=critical,CA:TRUE",
                "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            )  # fmt: skip

    def _run(self, *args: object) -> None:
        done = subprocess.run(
            [self._openssl, *map(str, args)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()}")

    def issue(self, name: str, *, server: bool = False, common_name: bool = True) -> CertFiles:
        """A certificate with common name ``name`` signed by this CA; with ``server``,
        also valid for 127.0.0.1 and localhost (and still usable as a client). Without
        ``common_name`` the subject is ``O=waltz, OU=name`` only (etcd's JSON gateway
        refuses client certificates with a CN when its authentication is on)."""
        key = self.directory / f"{name}.key"
        cert = self.directory / f"{name}.crt"
        if cert.exists():
            return CertFiles(cert, key, self.ca_cert)
        request = self.directory / f"{name}.csr"
        extensions = self.directory / f"{name}.ext"
        lines = [
            "extendedKeyUsage=serverAuth,clientAuth",
            "keyUsage=critical,digitalSignature,keyEncipherment",
        ]
        if server:
            lines.append("subjectAltName=IP:127.0.0.1,DNS:localhost")
        extensions.write_text("\n".join(lines) + "\n")
        self._run(
            "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", request,
            "-subj", f"/CN={name}" if common_name else f"/O=waltz/OU={name}",
        )  # fmt: skip
        self._run(
            "x509", "-req", "-in", request, "-CA", self.ca_cert, "-CAkey", self.ca_key,
            "-CAcreateserial", "-out", cert, "-days", VALID_DAYS, "-extfile", extensions,
        )  # fmt: skip
        key.chmod(0o600)
        return CertFiles(cert, key, self.ca_cert)
