"""Options a coordination plugin reads to reach a secured service: TLS and a login.

One parser for every plugin (``zk``, ``etcd``), so the same keys mean the same thing
in a URI query (``zk://zk1:2281/waltz?tls=true&tls_ca=/etc/waltz/ca.pem``) and in a
``[coordination.options]`` table, and are validated the same way (a ConfigError
naming the key and what to do):

- ``tls`` (bool): use TLS. Implied by any other ``tls_*`` option.
- ``tls_ca``: PEM file of the CA(s) the server's certificate must chain to
  (default: the system's trusted CAs).
- ``tls_cert`` / ``tls_key``: this client's certificate and key (PEM), for a
  server that requires client certificates; both or neither.
- ``tls_key_password``: the key's password, if it is encrypted.
- ``tls_check_hostname`` (bool, default true): the server's certificate must name
  the host this client connects to.
- ``username`` with ``password`` or ``password_file`` (a file holding the password;
  keeps it out of URIs and process listings).
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from waltz_api.errors import ConfigError

if TYPE_CHECKING:
    from waltz_api.hookspecs import OptionSpec

TLS_KEYS = ("tls", "tls_ca", "tls_cert", "tls_key", "tls_key_password", "tls_check_hostname")
LOGIN_KEYS = ("username", "password", "password_file")

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def bool_option(options: Mapping[str, Any], key: str, default: bool) -> bool:
    """A boolean option (a bool, or text such as ``true``/``false`` from a URI)."""
    value = options.get(key, default)
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise ConfigError(
        f"coordination option {key} must be true or false, got {value!r}",
        key=f"coordination.{key}",
    )


def _file(options: Mapping[str, Any], key: str) -> Path | None:
    value = options.get(key)
    if value is None or value == "":
        return None
    path = Path(str(value)).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"coordination option {key} names {str(path)!r}, which is not a readable file",
            key=f"coordination.{key}",
        )
    return path


@dataclass(frozen=True)
class TlsOptions:
    """How to reach a server over TLS (see the module docstring)."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    key_password: str | None = None
    check_hostname: bool = True

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> TlsOptions | None:
        """The TLS settings in ``options``, or None when TLS is off."""
        implied = any(options.get(k) not in (None, "") for k in TLS_KEYS if k != "tls")
        if not bool_option(options, "tls", implied):
            if implied:
                given = [k for k in TLS_KEYS if k != "tls" and options.get(k) not in (None, "")]
                raise ConfigError(
                    f"coordination options {', '.join(given)} are set but tls is false; "
                    "remove them or set tls=true",
                    key="coordination.tls",
                )
            return None
        cert, key = _file(options, "tls_cert"), _file(options, "tls_key")
        if (cert is None) != (key is None):
            missing = "tls_key" if key is None else "tls_cert"
            raise ConfigError(
                f"a client certificate needs both tls_cert and tls_key; {missing} is missing",
                key=f"coordination.{missing}",
            )
        password = options.get("tls_key_password")
        try:
            tls = cls(
                ca=_file(options, "tls_ca"),
                cert=cert,
                key=key,
                key_password=None if password in (None, "") else str(password),
                check_hostname=bool_option(options, "tls_check_hostname", True),
            )
            tls.context()  # the files must load: say so now, not at the first connection
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError(
                f"the TLS files of the coordination options do not load ({exc}): tls_ca must "
                "be PEM certificates, tls_cert/tls_key a PEM certificate and its key",
                key="coordination.tls_cert" if cert else "coordination.tls_ca",
            ) from None
        return tls

    def context(self) -> ssl.SSLContext:
        """A client SSLContext: verifies the server (this CA, or the system's), sends the
        client certificate when one is set."""
        context = ssl.create_default_context(cafile=None if self.ca is None else str(self.ca))
        context.check_hostname = self.check_hostname
        if self.cert is not None and self.key is not None:
            context.load_cert_chain(str(self.cert), str(self.key), self.key_password)
        return context


@dataclass(frozen=True)
class Login:
    """A user name and password (see the module docstring)."""

    username: str
    password: str

    def __repr__(self) -> str:  # never print the password
        return f"Login(username={self.username!r})"

    @classmethod
    def from_options(cls, options: Mapping[str, Any], *, required: bool = False) -> Login | None:
        username = options.get("username")
        password = options.get("password")
        password_file = _file(options, "password_file")
        if username in (None, ""):
            if password not in (None, "") or password_file is not None:
                raise ConfigError(
                    "a coordination password is set but no username", key="coordination.username"
                )
            if required:
                raise ConfigError(
                    "this coordination authentication needs username and password "
                    "(or password_file)",
                    key="coordination.username",
                )
            return None
        if password not in (None, "") and password_file is not None:
            raise ConfigError(
                "set coordination password or password_file, not both",
                key="coordination.password",
            )
        if password_file is not None:
            password = password_file.read_text().rstrip("\r\n")
        if password in (None, ""):
            raise ConfigError(
                f"coordination user {username!r} needs a password (password or password_file)",
                key="coordination.password",
            )
        return cls(str(username), str(password))


def tls_option_specs(port: str) -> list[OptionSpec]:
    """The documented TLS options (``TLS_KEYS``) of a plugin that reads them; ``port``
    names the service's TLS port (``ZooKeeper's `secureClientPort```)."""
    from waltz_api.hookspecs import OptionSpec

    specs = [
        OptionSpec(
            "tls", "bool", False, f"connect over TLS ({port}); implied by any `tls_*` option"
        ),
        OptionSpec(
            "tls_ca",
            "path",
            "",
            "PEM CA certificate(s) of the server's certificate (default: the system's)",
        ),
        OptionSpec(
            "tls_cert",
            "path",
            "",
            "this client's certificate (PEM), for a server requiring client certificates",
        ),
        OptionSpec("tls_key", "path", "", "the key of `tls_cert` (PEM)"),
        OptionSpec("tls_key_password", "str", "", "the password of an encrypted `tls_key`"),
        OptionSpec(
            "tls_check_hostname",
            "bool",
            True,
            "the server's certificate must name the host connected to",
        ),
    ]
    assert tuple(s.key for s in specs) == TLS_KEYS
    return specs


def login_option_specs() -> list[OptionSpec]:
    """The documented login options (``LOGIN_KEYS``)."""
    from waltz_api.hookspecs import OptionSpec

    specs = [
        OptionSpec("username", "str", "", "the cluster's identity on the coordination service"),
        OptionSpec(
            "password",
            "str",
            "",
            "its password (prefer `password_file`: URIs show up in process lists)",
        ),
        OptionSpec("password_file", "path", "", "a file holding the password (one line)"),
    ]
    assert tuple(s.key for s in specs) == LOGIN_KEYS
    return specs
