"""The conformance harness of the ``etcd`` plugin, on a real etcd cluster.

Needs waltz-conformance (the test extra). Sessions are expired the way etcd
expires them: the lease is revoked on the server, which deletes its keys;
the client learns it (LOST) at its next keep-alive.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from waltz_api.contracts.coordination import Coordination
from waltz_api.errors import CoordinationError
from waltz_conformance.servers.etcd import EtcdCluster
from waltz_conformance.suites.coordination import SERVER_RESTART, CoordinationHarness
from waltz_coord_etcd.coordination import EtcdCoordination


@dataclass
class EtcdCoordinationHarness(CoordinationHarness):
    """Clients of ``etcd`` on ``cluster`` (a running :class:`EtcdCluster`).

    ``kill_server`` kills -9 every member (the whole service) and
    ``restart_server`` starts them again on their data dirs."""

    cluster: EtcdCluster | None = None
    client_options: Mapping[str, str] = field(default_factory=dict)
    """URI query options of a secured cluster (TLS, login)."""

    def _cluster(self) -> EtcdCluster:
        if self.cluster is None:
            raise CoordinationError("EtcdCoordinationHarness needs a running EtcdCluster")
        return self.cluster

    async def connect(self, root: str) -> Coordination:
        return EtcdCoordination(
            self._cluster().uri(root, self.client_options),
            {"session_timeout": self.session_timeout},
        )

    def client_uri(self, root: str) -> str:
        return self._cluster().uri(root, self.client_options)

    async def expire_session(self, client: Coordination) -> None:
        if not isinstance(client, EtcdCoordination):
            raise TypeError(f"not an etcd client: {client!r}")
        await asyncio.to_thread(self._cluster().revoke_lease, client.session_id)

    async def kill_server(self) -> None:
        cluster = self._cluster()
        for index in range(len(cluster.members)):
            await asyncio.to_thread(cluster.kill_member, index)

    async def restart_server(self) -> None:
        await asyncio.to_thread(self._cluster().ensure_all_running)


def harness(options: Mapping[str, Any] | None = None) -> EtcdCoordinationHarness:
    """The harness for the coordination suite: ``options["cluster"]`` is a running
    :class:`EtcdCluster`; ``options["session_timeout"]`` defaults to 10 s."""
    options = dict(options or {})
    cluster = options.get("cluster")
    if not isinstance(cluster, EtcdCluster):
        raise CoordinationError(
            "the etcd conformance harness needs options['cluster']: a running EtcdCluster "
            "(the etcd_cluster fixture of waltz_conformance.servers.etcd)"
        )
    return EtcdCoordinationHarness(
        name="etcd",
        capabilities=frozenset({SERVER_RESTART, "cross_process"}),
        session_timeout=float(options.get("session_timeout", 10.0)),
        cluster=cluster,
        client_options=dict(options.get("client_options", {})),
    )
