"""The storage node (``waltz storage``): serves a storage engine's partitions to servers.

- :class:`StorageNode`: the node (``main.run_from_config`` runs one from a config file).
- :class:`StorageClient`: the server side of the server-storage protocol (pipelined).
- :class:`StorageReplica`, :class:`StorageConnectionPool`, :func:`replica_connector`:
  the server's ``ReplicaConnection`` over a StorageClient.
- :class:`StorageAdminClient`: the admin commands (``waltz storage list`` ...).
"""

from __future__ import annotations

from waltz_storage_node.client import (
    StorageAdminClient,
    StorageClient,
    StorageConnectionPool,
    StorageReplica,
    replica_connector,
)
from waltz_storage_node.config import StorageNodeConfig, load_storage_config
from waltz_storage_node.node import StorageNode

__all__ = [
    "StorageAdminClient",
    "StorageClient",
    "StorageConnectionPool",
    "StorageNode",
    "StorageNodeConfig",
    "StorageReplica",
    "load_storage_config",
    "replica_connector",
]
