"""The storage node (``waltz storage``): serves a storage engine's partitions to servers.

- :class:`StorageNode`: the node (``main.run_from_config`` runs one from a config file).
- :class:`StorageNodeConfig`, :func:`load_storage_config`: its config file.
- :class:`StorageClient`, :class:`StorageAdminClient`: the protocol's requesting side and
  the admin commands (``waltz storage list`` ...), from :mod:`waltz_api.storage_client`
  (the server's replicas use them too: ``waltz_server.server.storage_client``).

The names below are imported on first use: the package's entry point
(:mod:`waltz_storage_node.plugin`) is read by every process that reads the plugins
(``waltz --help``), which must not cost the node.
"""

from typing import TYPE_CHECKING

from waltz_api.lazy import lazy_exports

if TYPE_CHECKING:
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
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "StorageAdminClient": "waltz_api.storage_client",
        "StorageClient": "waltz_api.storage_client",
        "StorageNode": ".node",
        "StorageNodeConfig": ".config",
        "load_storage_config": ".config",
    },
)
