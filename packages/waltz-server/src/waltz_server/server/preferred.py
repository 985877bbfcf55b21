"""Operator overrides of the servers' preferred partitions, kept in coordination.

A server states its preferred partitions in its config (``server.preferred_partitions``);
it registers them with its ephemeral ``/servers/<id>`` entry. An operator can
override them per server *endpoint* (the address clients reach it at, stable across
restarts, unlike the server id, which is new at every registration) with
``waltz server add-preferred-partition`` and friends. The overrides live in one
persistent node::

    /assignment/preferred    {"format": 1, "type": "preferred_partitions",
                              "endpoints": {"tcp://10.0.0.5:5600": [0, 3], ...}}

changed only by compare-and-set, so concurrent operators never lose each other's
changes. It survives server restarts (it is not ephemeral) and goes with the cluster
(``waltz cluster delete`` removes ``/assignment``).

For a live server the override for its endpoint, when there is one, *replaces* the
preferences of its config (an empty override means "no preferred partitions").
The cluster manager's leader watches the node and recomputes the assignment when
it changes (:func:`apply_overrides` before ``compute_assignment``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from waltz_api.cluster import ServerInfo
from waltz_api.contracts.coordination import Coordination, Versioned, Watch
from waltz_api.errors import (
    BadVersionError,
    ConfigError,
    CoordinationError,
    NodeExistsError,
    NoNodeError,
)

log = logging.getLogger(__name__)

PREFERRED_PATH = "/assignment/preferred"
FORMAT_VERSION = 1
ABSENT = -1
"""The version :meth:`PreferredPartitionStore.read` reports when the node does not exist."""
MAX_ATTEMPTS = 100

Overrides = Mapping[str, tuple[int, ...]]
"""Endpoint -> the partitions preferred there (sorted, unique)."""


@dataclass(frozen=True, slots=True)
class StoredOverrides:
    """The overrides and the version they were read at (:data:`ABSENT` when none was
    ever written)."""

    endpoints: Overrides
    version: int


def encode_overrides(overrides: Overrides) -> bytes:
    body = {
        "format": FORMAT_VERSION,
        "type": "preferred_partitions",
        "endpoints": {e: sorted(set(p)) for e, p in sorted(overrides.items())},
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def decode_overrides(raw: bytes, path: str = PREFERRED_PATH) -> dict[str, tuple[int, ...]]:
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CoordinationError(f"{path} does not hold Waltz metadata JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("type") != "preferred_partitions":
        raise CoordinationError(f"{path} does not hold preferred partitions metadata")
    found_format = doc.get("format")
    if not isinstance(found_format, int) or found_format < 1:
        raise CoordinationError(f"{path} has no valid metadata format number")
    if found_format > FORMAT_VERSION:
        raise CoordinationError(
            f"{path} was written in metadata format {found_format}, newer than this Waltz "
            f"understands ({FORMAT_VERSION}); upgrade Waltz"
        )
    try:
        return {
            str(endpoint): tuple(sorted({int(p) for p in parts}))
            for endpoint, parts in dict(doc.get("endpoints", {})).items()
        }
    except (TypeError, ValueError) as exc:
        raise CoordinationError(f"{path} holds invalid preferred partitions: {exc}") from None


def apply_overrides(servers: Iterable[ServerInfo], overrides: Overrides) -> list[ServerInfo]:
    """The live servers with their effective preferred partitions: the override for
    a server's endpoint when there is one, else what it registered (its config)."""
    return [
        replace(s, preferred_partitions=tuple(overrides[s.endpoint]))
        if s.endpoint in overrides
        else s
        for s in servers
    ]


class PreferredPartitionStore:
    """Reads, changes (by CAS) and watches the overrides through a started client."""

    def __init__(self, coordination: Coordination) -> None:
        self.coordination = coordination

    async def read(self) -> StoredOverrides:
        found = await self.coordination.get(PREFERRED_PATH)
        if found is None:
            return StoredOverrides({}, ABSENT)
        return StoredOverrides(decode_overrides(found.value), found.version)

    async def change(
        self,
        endpoint: str,
        update: Callable[[tuple[int, ...] | None], Sequence[int] | None],
        *,
        max_attempts: int = MAX_ATTEMPTS,
    ) -> tuple[int, ...] | None:
        """Set ``endpoint``'s override to ``update(current override or None)`` (None
        drops the override), by compare-and-set, retried (bounded) when another writer
        got there first. ``update`` must be pure: it may run several times. Returns the
        new override."""
        endpoint = validate_endpoint(endpoint)
        for _ in range(max_attempts):
            current = await self.read()
            new = update(current.endpoints.get(endpoint))
            updated = dict(current.endpoints)
            if new is None:
                updated.pop(endpoint, None)
            else:
                updated[endpoint] = tuple(sorted(set(new)))
            if updated == dict(current.endpoints):
                return updated.get(endpoint)
            raw = encode_overrides(updated)
            try:
                if current.version == ABSENT:
                    await self.coordination.create(PREFERRED_PATH, raw)
                else:
                    await self.coordination.set(
                        PREFERRED_PATH, raw, expected_version=current.version
                    )
            except (BadVersionError, NodeExistsError, NoNodeError):
                continue
            log.info("preferred partitions of %s: %s", endpoint, updated.get(endpoint))
            return updated.get(endpoint)
        raise CoordinationError(
            f"the preferred partitions kept changing under this update: no compare-and-set "
            f"succeeded in {max_attempts} attempts; try again"
        )

    async def watch(self, callback: Callable[[Overrides], Awaitable[None] | None]) -> Watch:
        """Call ``callback`` with the overrides now and after every change ({} when none)."""

        def on_value(value: Versioned | None) -> Awaitable[None] | None:
            if value is None:
                return callback({})
            try:
                overrides = decode_overrides(value.value)
            except CoordinationError as exc:
                log.error("ignoring the preferred partition overrides: %s", exc)
                return None
            return callback(overrides)

        return await self.coordination.watch(PREFERRED_PATH, on_value)


def validate_endpoint(endpoint: str) -> str:
    text = endpoint.strip()
    if not text:
        raise ConfigError(
            "a server endpoint is needed (as in `waltz server list`), e.g. tcp://10.0.0.5:5600",
            key="endpoint",
        )
    return text


def validate_partitions(partitions: Iterable[int], num_partitions: int) -> list[int]:
    """The partitions, sorted; ConfigError naming the ones the cluster does not have."""
    found = sorted(set(partitions))
    bad = [p for p in found if not 0 <= p < num_partitions]
    if bad:
        raise ConfigError(
            f"partitions {bad} do not exist: the cluster has {num_partitions} partitions "
            f"(0..{num_partitions - 1})",
            key="partition",
        )
    return found
