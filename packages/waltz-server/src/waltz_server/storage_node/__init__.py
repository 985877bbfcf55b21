"""The storage node (``waltz storage``): serves a storage engine's partitions to servers."""

from __future__ import annotations

from waltz_server.storage_node.client import StorageAdminClient, StorageClient
from waltz_server.storage_node.config import StorageNodeConfig, load_storage_config
from waltz_server.storage_node.node import StorageNode

__all__ = [
    "StorageAdminClient",
    "StorageClient",
    "StorageNode",
    "StorageNodeConfig",
    "load_storage_config",
]
