"""The server's configuration schema (``waltz server --config server.toml``).

Example::

    log_level = "INFO"
    log_format = "text"                    # or "json": one object per line

    [coordination]
    uri = "zk://127.0.0.1:2181/waltz"     # or etcd://..., local:///path
    [coordination.options]                 # passed to the plugin as-is

    [transport]
    plugin = "zmq"
    endpoint = "tcp://127.0.0.1:5600"      # where this server listens for clients
    advertised_endpoint = ""               # what clients are told (default: endpoint)
    storage_endpoint = "tcp://{}"          # a storage node's endpoint from its host:port
    [transport.options]

    [server]
    preferred_partitions = [0, 1]
    peer_suspect_after = 1.5               # a silent server's partitions move after this
    lock_table = "hwm-array"               # a lock table plugin name
    [server.lock_table_options]
    size = 30000
    [server.archive]                       # tiered storage (docs/archive.md); off by default
    url = "s3://bucket/waltz"              # any fsspec URL: file://, s3://, gs://...

    [http]                                 # /livez, /readyz and Prometheus /metrics
    enabled = true
    port = 9600

Every key can be overridden by environment: ``WALTZ_COORDINATION__URI``,
``WALTZ_TRANSPORT__ENDPOINT``, ``WALTZ_SERVER__LOCK_TABLE``...
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from waltz_api.config import load_config
from waltz_api.errors import ConfigError
from waltz_api.http_endpoint import HttpSection
from waltz_api.process import log_format_field, log_level_field
from waltz_server.server.archiving import ArchiveSection
from waltz_server.server.liveness import (
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_SUSPECT_AFTER,
    LivenessConfig,
)
from waltz_server.server.partition import PartitionConfig
from waltz_server.server.server import ServerConfig
from waltz_server.server.store import StoreConfig


@dataclass
class CoordinationSection:
    uri: str = field(metadata={"help": "coordination service URI (zk://, etcd://, local://)"})
    options: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "coordination plugin options, passed as-is"}
    )

    def __post_init__(self) -> None:
        if "://" not in self.uri:
            raise ConfigError(
                f"config key 'coordination.uri' must be a URI such as "
                f"zk://127.0.0.1:2181/waltz, got {self.uri!r}",
                "coordination.uri",
            )


@dataclass
class ServerTransportSection:
    endpoint: str = field(metadata={"help": "the endpoint this server listens on"})
    plugin: str = field(default="zmq", metadata={"help": "transport plugin name"})
    advertised_endpoint: str = field(
        default="", metadata={"help": "the endpoint clients are told (default: endpoint)"}
    )
    storage_endpoint: str = field(
        default="tcp://{}",
        metadata={"help": "a storage node's endpoint, {} being its host:port"},
    )
    options: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "transport options, passed as-is"}
    )

    def __post_init__(self) -> None:
        if not self.endpoint.strip():
            raise ConfigError(
                "config key 'transport.endpoint' must not be empty (e.g. 'tcp://127.0.0.1:5600')",
                "transport.endpoint",
            )
        if "{}" not in self.storage_endpoint:
            raise ConfigError(
                "config key 'transport.storage_endpoint' must contain {} (the storage node's "
                f"host:port), e.g. 'tcp://{{}}'; got {self.storage_endpoint!r}",
                "transport.storage_endpoint",
            )


@dataclass
class ServerSection:
    preferred_partitions: list[int] = field(
        default_factory=list, metadata={"help": "partitions this server prefers to serve"}
    )
    lock_table: str = field(default="hwm-array", metadata={"help": "lock table plugin name"})
    lock_table_options: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "lock table options, passed as-is"}
    )
    append_queue_size: int = field(
        default=2000, metadata={"min": 1, "help": "appends queued per partition"}
    )
    feed_cache_bytes: int = field(
        default=8 * 1024 * 1024, metadata={"min": 1024, "help": "feed cache per partition"}
    )
    data_cache_bytes: int = field(
        default=64 * 1024 * 1024,
        metadata={"min": 0, "help": "transaction data cache per partition"},
    )
    max_batch_records: int = field(
        default=512, metadata={"min": 1, "help": "records per storage append"}
    )
    max_pending_records: int = field(
        default=8192, metadata={"min": 1, "help": "uncommitted appends before appends wait"}
    )
    max_window_bytes: int = field(
        default=32 * 1024 * 1024,
        metadata={"min": 1024, "help": "recent records kept in memory for lagging replicas"},
    )
    checkpoint_interval: int = field(
        default=250_000,
        metadata={"min": 1, "help": "transactions per store session before a new one"},
    )
    outbox_frames: int = field(
        default=10_000, metadata={"min": 1, "help": "replies queued per client connection"}
    )
    outbox_bytes: int = field(
        default=8 * 1024 * 1024,
        metadata={"min": 1024, "help": "reply bytes queued per client connection"},
    )
    peer_heartbeat_interval: float = field(
        default=DEFAULT_HEARTBEAT_INTERVAL,
        metadata={
            "min": 0.01,
            "max": 10.0,
            "help": "seconds between two pings of every other server (failure detection)",
        },
    )
    archive: ArchiveSection = field(
        default_factory=ArchiveSection,
        metadata={"help": "tiered storage: old records archived as Parquet (docs/archive.md)"},
    )
    peer_suspect_after: float = field(
        default=DEFAULT_SUSPECT_AFTER,
        metadata={
            "min": 0.05,
            "max": 600.0,
            "help": "seconds a server may not answer before its partitions move "
            "(its own pauses not counted; at least 4 heartbeat intervals)",
        },
    )

    def __post_init__(self) -> None:
        self.liveness_config()  # the two timings checked together

    def liveness_config(self) -> LivenessConfig:
        return LivenessConfig(
            heartbeat_interval=self.peer_heartbeat_interval,
            suspect_after=self.peer_suspect_after,
        )

    def to_server_config(self) -> ServerConfig:
        return ServerConfig(
            outbox_frames=self.outbox_frames,
            outbox_bytes=self.outbox_bytes,
            store=StoreConfig(
                max_batch_records=self.max_batch_records,
                max_pending_records=self.max_pending_records,
                max_window_bytes=self.max_window_bytes,
                checkpoint_interval=self.checkpoint_interval,
            ),
            partition=PartitionConfig(
                lock_table=self.lock_table,
                lock_table_options=dict(self.lock_table_options),
                append_queue_size=self.append_queue_size,
                feed_cache_bytes=self.feed_cache_bytes,
                data_cache_bytes=self.data_cache_bytes,
            ),
        )


@dataclass
class ServerNodeConfig:
    coordination: CoordinationSection
    transport: ServerTransportSection
    server: ServerSection = field(default_factory=ServerSection)
    http: HttpSection = field(default_factory=HttpSection)
    log_level: str = log_level_field()
    log_format: str = log_format_field()


def load_server_config(
    path: str | os.PathLike[str] | None,
    *,
    env: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> ServerNodeConfig:
    """Read and validate a server config file (plus ``WALTZ_*`` overrides)."""
    return load_config(ServerNodeConfig, path, env=env, overrides=overrides)
