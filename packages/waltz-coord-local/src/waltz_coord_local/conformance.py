"""The conformance harness of the ``local`` plugin (a database file in a temp dir).

Needs waltz-conformance (the test extra). A session is expired the way it
expires when its owner stops heartbeating: its deadline is moved into the
past and it is reaped (its ephemeral entries deleted); the client learns it
(LOST) at its next heartbeat.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from waltz_api.contracts.coordination import Coordination
from waltz_api.errors import CoordinationError
from waltz_conformance.suites.coordination import CoordinationHarness
from waltz_coord_local.coordination import LocalCoordination


@dataclass
class LocalCoordinationHarness(CoordinationHarness):
    """Clients of ``local`` on the database at ``location``."""

    location: Path | None = None

    def _location(self) -> Path:
        if self.location is None:
            self.location = Path(tempfile.mkdtemp(prefix="waltz-local-coord-"))
        return self.location

    async def connect(self, root: str) -> Coordination:
        return LocalCoordination(
            self._location(), {"root": root, "session_timeout": self.session_timeout}
        )

    def client_uri(self, root: str) -> str:
        return f"local://{self._location()}?root={root}"

    async def expire_session(self, client: Coordination) -> None:
        if not isinstance(client, LocalCoordination):
            raise TypeError(f"not a local client: {client!r}")
        admin = LocalCoordination(self._location(), {"session_timeout": self.session_timeout})
        await admin.start()
        try:
            await admin.expire_session_of(client.session_id)
        finally:
            await admin.close()


def harness(options: Mapping[str, Any] | None = None) -> LocalCoordinationHarness:
    """The harness for the coordination suite: ``options["location"]`` is a directory
    (a fresh temp dir when absent); ``options["session_timeout"]`` defaults to 3 s."""
    options = dict(options or {})
    location = options.get("location")
    if location is not None and not isinstance(location, str | Path):
        raise CoordinationError(f"options['location'] must be a path, got {location!r}")
    return LocalCoordinationHarness(
        name="local",
        capabilities=frozenset({"cross_process"}),
        session_timeout=float(options.get("session_timeout", 3.0)),
        location=Path(location) if location is not None else None,
    )
