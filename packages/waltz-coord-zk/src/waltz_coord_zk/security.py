"""How the ``zk`` plugin reaches a secured ZooKeeper: TLS, a login, znode ACLs.

Options (URI query parameters or ``[coordination.options]``; the TLS and login keys
are :mod:`waltz_api.security`'s):

- TLS: ``tls``, ``tls_ca``, ``tls_cert``, ``tls_key``, ``tls_key_password``,
  ``tls_check_hostname`` (ZooKeeper's ``secureClientPort``, Netty).
- ``auth``: ``digest`` (ZooKeeper's digest scheme, ``addauth digest user:password``;
  no server setting needed) or ``sasl`` (SASL DIGEST-MD5 against the server's JAAS
  users; needs the ``pure-sasl`` package), with ``username`` and ``password`` or
  ``password_file``.
- ``acl``: the ACL of every znode this client creates. ``world-read`` (the default
  with ``auth``): the cluster's identity may do anything, everyone else only read;
  ``private``: only the cluster's identity, reading included (then every client and
  tool needs the login too); ``open`` (the default without ``auth``, ZooKeeper's
  own default): anyone may do anything.

Every process of a cluster (servers, storage nodes, clients, ``waltz`` commands)
uses the same identity; the ACL names it, so no other identity can change Waltz's
znodes (a ZooKeeper super user aside).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kazoo.security import ACL, make_acl, make_digest_acl

from waltz_api.errors import ConfigError
from waltz_api.security import LOGIN_KEYS, TLS_KEYS, Login, TlsOptions

AUTH_SCHEMES = ("digest", "sasl")
ACL_POLICIES = ("open", "world-read", "private")
SECURITY_KEYS = (*TLS_KEYS, *LOGIN_KEYS, "auth", "acl")


@dataclass(frozen=True)
class ZkSecurity:
    tls: TlsOptions | None = None
    auth: str | None = None
    login: Login | None = None
    acl: str = "open"

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> ZkSecurity:
        tls = TlsOptions.from_options(options)
        auth = options.get("auth") or None
        if auth is not None and auth not in AUTH_SCHEMES:
            raise ConfigError(
                f"coordination option auth must be one of {', '.join(AUTH_SCHEMES)}, got {auth!r}",
                key="coordination.auth",
            )
        login = Login.from_options(options, required=auth is not None)
        if login is not None and auth is None:
            raise ConfigError(
                "a coordination username is set but no auth scheme: add auth=digest (or sasl)",
                key="coordination.auth",
            )
        acl = options.get("acl") or ("world-read" if auth else "open")
        if acl not in ACL_POLICIES:
            raise ConfigError(
                f"coordination option acl must be one of {', '.join(ACL_POLICIES)}, got {acl!r}",
                key="coordination.acl",
            )
        if acl != "open" and auth is None:
            raise ConfigError(
                f"acl={acl} names the cluster's identity, but there is none: set auth, "
                "username and password",
                key="coordination.acl",
            )
        if auth == "sasl" and importlib.util.find_spec("puresasl") is None:
            raise ConfigError(
                "auth=sasl needs the pure-sasl package: pip install 'waltz-coord-zk[sasl]' "
                "(or use auth=digest)",
                key="coordination.auth",
            )
        return cls(tls, auth, login, str(acl))

    @property
    def secured(self) -> bool:
        return self.tls is not None or self.auth is not None

    def kazoo_options(self) -> dict[str, Any]:
        """KazooClient keyword arguments for TLS, the login and the default ACL."""
        options: dict[str, Any] = {}
        if self.tls is not None:
            options.update(
                use_ssl=True,
                verify_certs=True,
                check_hostname=self.tls.check_hostname,
                ca=None if self.tls.ca is None else str(self.tls.ca),
                certfile=None if self.tls.cert is None else str(self.tls.cert),
                keyfile=None if self.tls.key is None else str(self.tls.key),
                keyfile_password=self.tls.key_password,
            )
        if self.login is not None:
            if self.auth == "digest":
                options["auth_data"] = [("digest", f"{self.login.username}:{self.login.password}")]
            else:
                options["sasl_options"] = {
                    "mechanism": "DIGEST-MD5",
                    "username": self.login.username,
                    "password": self.login.password,
                }
        acl = self.default_acl()
        if acl is not None:
            options["default_acl"] = acl
        return options

    def default_acl(self) -> list[ACL] | None:
        if self.acl == "open" or self.login is None:
            return None
        if self.auth == "digest":
            owner = make_digest_acl(self.login.username, self.login.password, all=True)
        else:
            owner = make_acl("sasl", self.login.username, all=True)
        if self.acl == "private":
            return [owner]
        return [owner, make_acl("world", "anyone", read=True)]
