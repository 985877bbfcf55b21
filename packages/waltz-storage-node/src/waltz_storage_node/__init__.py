"""The storage node (``waltz storage``): serves a storage engine's partitions to servers.

- :class:`StorageNode`: the node (``main.run_from_config`` runs one from a config file).
- :class:`StorageNodeConfig`, :func:`load_storage_config`: its config file.
- :class:`StorageClient`, :class:`StorageAdminClient`: the protocol's requesting side and
  the admin commands (``waltz storage list`` ...), from :mod:`waltz_api.storage_client`
  (the server's replicas use them too: ``waltz_server.server.storage_client``).
"""

from __future__ import annotations

from waltz_api.storage_client import StorageAdminClient, StorageClient
from waltz_storage_node.config import StorageNodeConfig, load_storage_config
from waltz_storage_node.node import StorageNode

__all__ = [
    "StorageAdminClient",
    "StorageClient",
    "StorageNode",
    "StorageNodeConfig",
    "load_storage_config",
]
