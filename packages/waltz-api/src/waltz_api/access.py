"""Access control: per-partition permissions of client keys (``waltz acl``).

The cluster's ACL is one value in the coordination service (``/acl``, JSON like the
rest of the cluster metadata, changed by compare-and-set). It grants each client
*identity* (the string a transport's security handshake accepted,
``Connection.peer_identity``: for CurveZMQ the client's public key in Z85) a
permission on each partition or on every partition:

- ``read``: mount, feed, data fetch, range read, high-water mark, flush;
- ``write``: append, and read (a writer learns its outcomes from its feed);
- ``admin``: write and read. No request of the client protocol needs more than write
  today; admin is the level for administrative requests the servers may serve later.

A permission includes those below it; a key's permission on a partition is the
higher of its grant there and its grant on every partition. ``enforced`` turns the
ACL on: then a request is served only when its key has the permission it needs, and a
connection without an authenticated key (plaintext) is served nothing. Not enforced
(no ``/acl``, or ``waltz acl disable``): every connection may do everything, as
before ACLs existed; grants can be prepared and checked before ``waltz acl enable``.
"""

from __future__ import annotations

import enum
import json
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from waltz_api.errors import ConfigError, CoordinationError
from waltz_api.messages import AppendRequest, Message

ACL_PATH = "/acl"
"""The ACL's path under the coordination root (one value; absent: not enforced)."""

ACL_FORMAT = 1
EVERY_PARTITION = -1
"""The partition of a grant on every partition (``all`` in the CLI and the JSON)."""
MAX_IDENTITY_LENGTH = 256
MAX_NAME_LENGTH = 100

_IDENTITY = re.compile(rf"^[\x21-\x7e]{{1,{MAX_IDENTITY_LENGTH}}}$")
"""Printable ASCII without spaces (a Z85 key is 40 of these)."""
_Z85 = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
_PUBLIC_KEY_LINE = re.compile(r'^\s*public-key\s*=\s*"([^"]*)"\s*$', re.MULTILINE)


class Permission(enum.IntEnum):
    """What a key may do on a partition; each includes the ones below it."""

    READ = 1
    WRITE = 2
    ADMIN = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Permission:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ConfigError(
                f"unknown permission {text!r}: use read, write or admin", key="permission"
            ) from None


def check_identity(identity: str) -> str:
    """``identity`` when it can be a peer identity (printable ASCII, no spaces, at most
    256 characters), else ConfigError."""
    if not isinstance(identity, str) or not _IDENTITY.fullmatch(identity):
        raise ConfigError(
            f"{identity!r} is not a client key: give a CurveZMQ public key (40 Z85 "
            "characters) or its NAME.key file (`waltz keys generate`)",
            key="key",
        )
    return identity


def is_curve_key(identity: str) -> bool:
    """Whether ``identity`` looks like a CurveZMQ public key (40 Z85 characters)."""
    return bool(_Z85.fullmatch(identity))


def read_key_file(path: str | Path) -> str:
    """The public key (Z85) in a ``NAME.key`` (or ``NAME.key_secret``) file written by
    ``waltz keys generate``."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError(f"cannot read the key file {path}: {exc.strerror}", key="key") from None
    found = _PUBLIC_KEY_LINE.search(text)
    if found is None or not is_curve_key(found.group(1)):
        raise ConfigError(
            f"{path} holds no CurveZMQ public key (a NAME.key file of `waltz keys generate` "
            'has a line public-key = "<40 Z85 characters>")',
            key="key",
        )
    return found.group(1)


@dataclass(frozen=True)
class KeyGrants:
    """One key's grants: its permission per partition (EVERY_PARTITION: on all), and a
    name for people (the key file's name, or ``--name``)."""

    partitions: Mapping[int, Permission] = field(default_factory=dict)
    name: str = ""


@dataclass(frozen=True)
class AccessControl:
    """The cluster's ACL (immutable: the changes return a new one)."""

    enforced: bool = False
    keys: Mapping[str, KeyGrants] = field(default_factory=dict)

    # -- reading ---------------------------------------------------------------------------

    def permission(self, identity: str | None, partition_id: int) -> Permission | None:
        """The key's permission on the partition from its grants (None: none), whether
        or not the ACL is enforced."""
        if identity is None:
            return None
        grants = self.keys.get(identity)
        if grants is None:
            return None
        here = grants.partitions.get(partition_id)
        everywhere = grants.partitions.get(EVERY_PARTITION)
        found = [p for p in (here, everywhere) if p is not None]
        return max(found) if found else None

    def allows(self, identity: str | None, partition_id: int, needed: Permission) -> bool:
        """Whether a connection of ``identity`` (None: not authenticated) may do what
        needs ``needed`` on the partition: always when the ACL is not enforced."""
        if not self.enforced:
            return True
        held = self.permission(identity, partition_id)
        return held is not None and held >= needed

    def identity_named(self, name: str) -> str | None:
        """The key granted under ``name`` (None: no key has that name)."""
        for identity, grants in self.keys.items():
            if grants.name and grants.name == name:
                return identity
        return None

    def rows(self) -> list[dict[str, Any]]:
        """One row per grant (key, name, partition, permission), sorted."""
        rows = []
        for identity in sorted(self.keys):
            grants = self.keys[identity]
            for partition in sorted(grants.partitions):
                rows.append(
                    {
                        "key": identity,
                        "name": grants.name,
                        "partition": partition_label(partition),
                        "permission": grants.partitions[partition].label,
                    }
                )
        return rows

    # -- changing ------------------------------------------------------------------------------

    def granted(
        self,
        identity: str,
        partitions: Iterable[int],
        permission: Permission,
        name: str | None = None,
    ) -> AccessControl:
        """``identity`` gets at least ``permission`` on each of ``partitions``
        (EVERY_PARTITION for all); a higher grant there is kept. ``name`` replaces the
        key's name when given."""
        check_identity(identity)
        current = self.keys.get(identity, KeyGrants())
        changed = dict(current.partitions)
        for partition in partitions:
            held = changed.get(partition)
            changed[partition] = permission if held is None else max(held, permission)
        new_name = current.name if name is None else check_name(name)
        return self._with(identity, KeyGrants(changed, new_name))

    def revoked(
        self,
        identity: str,
        partitions: Iterable[int] | None = None,
        permission: Permission | None = None,
    ) -> AccessControl:
        """``identity`` no longer holds ``permission`` (nor any that includes it) through
        its grants on ``partitions`` (None: every grant of the key): a grant of it or
        above drops to the permission below (read: removed). Without ``permission``,
        the grants are removed. A key left without grants is removed."""
        current = self.keys.get(identity)
        if current is None:
            return self
        scope = set(current.partitions) if partitions is None else set(partitions)
        changed: dict[int, Permission] = {}
        for partition, held in current.partitions.items():
            if partition in scope and (permission is None or held >= permission):
                if permission is None or permission is Permission.READ:
                    continue
                changed[partition] = Permission(permission - 1)
            else:
                changed[partition] = held
        return self._with(identity, KeyGrants(changed, current.name) if changed else None)

    def with_enforced(self, enforced: bool) -> AccessControl:
        return replace(self, enforced=enforced)

    def _with(self, identity: str, grants: KeyGrants | None) -> AccessControl:
        keys = dict(self.keys)
        if grants is None:
            keys.pop(identity, None)
        else:
            keys[identity] = grants
        return replace(self, keys=keys)


def check_name(name: str) -> str:
    text = name.strip()
    if len(text) > MAX_NAME_LENGTH or any(not c.isprintable() for c in text):
        raise ConfigError(
            f"key name {name!r} is invalid: at most {MAX_NAME_LENGTH} printable characters",
            key="name",
        )
    return text


def partition_label(partition_id: int) -> str | int:
    return "all" if partition_id == EVERY_PARTITION else partition_id


def parse_partition(text: str | int) -> int:
    """A partition id of a grant (``all``: EVERY_PARTITION)."""
    if isinstance(text, str) and text.strip().lower() in ("all", "*"):
        return EVERY_PARTITION
    try:
        partition = int(text)
    except (TypeError, ValueError):
        raise ConfigError(
            f"partition {text!r} is neither a partition id nor 'all'", key="partition"
        ) from None
    if partition < 0:
        raise ConfigError(f"partition {partition} is negative", key="partition")
    return partition


# -- encoding -----------------------------------------------------------------------------------


def encode_access_control(acl: AccessControl) -> bytes:
    keys: dict[str, Any] = {}
    for identity in sorted(acl.keys):
        grants = acl.keys[identity]
        keys[identity] = {
            "name": grants.name,
            "partitions": {
                str(partition_label(p)): grants.partitions[p].label
                for p in sorted(grants.partitions)
            },
        }
    doc = {"format": ACL_FORMAT, "type": "acl", "enforced": acl.enforced, "keys": keys}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")


def decode_access_control(raw: bytes, path: str = ACL_PATH) -> AccessControl:
    """The ACL at ``path``; CoordinationError when it is not one this Waltz can read (a
    server then refuses every request rather than guess)."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CoordinationError(f"{path} does not hold Waltz ACL JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("type", "acl") != "acl":
        raise CoordinationError(f"{path} does not hold a Waltz ACL")
    found_format = doc.get("format", ACL_FORMAT)
    if not isinstance(found_format, int) or found_format < 1:
        raise CoordinationError(f"{path} has no valid ACL format number")
    if found_format > ACL_FORMAT:
        raise CoordinationError(
            f"{path} was written in ACL format {found_format}, newer than this Waltz "
            f"understands ({ACL_FORMAT}); upgrade Waltz"
        )
    try:
        enforced = doc.get("enforced", False)
        if not isinstance(enforced, bool):
            raise ValueError(f"enforced is {enforced!r}, not true or false")
        keys: dict[str, KeyGrants] = {}
        for identity, entry in dict(doc.get("keys", {})).items():
            check_identity(identity)
            partitions = {
                parse_partition(p): Permission.parse(str(level))
                for p, level in dict(entry.get("partitions", {})).items()
            }
            keys[identity] = KeyGrants(partitions, check_name(str(entry.get("name", ""))))
    except (ConfigError, TypeError, ValueError, AttributeError) as exc:
        raise CoordinationError(f"{path} holds an invalid ACL: {exc}") from None
    return AccessControl(enforced, keys)


def describe(acl: AccessControl | None) -> dict[str, Any]:
    """The ACL as JSON-able data (``waltz acl list``)."""
    if acl is None:
        return {"exists": False, "enforced": False, "grants": []}
    return {"exists": True, "enforced": acl.enforced, "grants": acl.rows()}


def needed_for(request: Message) -> Permission:
    """The permission a client request needs on its partition: write for an append,
    read for everything else (mount, feed, data fetch, range read, high-water mark,
    flush: each reveals the log or its mark)."""
    return Permission.WRITE if isinstance(request, AppendRequest) else Permission.READ


def denial(identity: str | None, partition_id: int, needed: Permission, acl: AccessControl) -> str:
    """What a refused request is told (and the server logs)."""
    if identity is None:
        return (
            f"access denied: partition {partition_id} needs the {needed.label} permission and "
            "this connection has no authenticated client key (plaintext): the cluster's ACL "
            "is enforced, so only clients with a granted CurveZMQ key are served"
        )
    held = acl.permission(identity, partition_id)
    has = f"holds {held.label} only" if held is not None else "holds no permission there"
    return (
        f"access denied: partition {partition_id} needs the {needed.label} permission, and "
        f"client key {identity} {has}; an operator grants it with `waltz acl grant --key "
        f"{shlex.quote(identity)} --partition {partition_id} --permission {needed.label}`"
    )
