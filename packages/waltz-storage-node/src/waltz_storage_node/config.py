"""The storage node's configuration schema (``waltz storage --config storage.toml``).

Example::

    log_level = "INFO"
    log_format = "text"                    # or "json": one object per line

    [storage]
    data_dir = "/var/lib/waltz/storage"
    engine = "fs"                     # a storage engine plugin name
    cluster_key = "6f1c...-..."       # needed to create a new data dir; checked otherwise
    num_partitions = 8                # likewise
    partitions = [0, 1, 2, 3]         # hosted from start-up (added when missing)
    [storage.options]                 # passed to the engine as-is
    segment_size = 1073741824
    [storage.scrub]                   # background verification of the sealed records
    enabled = true
    rate_bytes_per_second = 4194304   # most bytes read per second by it
    interval = 86400.0                # seconds from one pass's start to the next's

    [transport]
    plugin = "zmq"                    # a transport plugin name
    endpoint = "tcp://127.0.0.1:5500"
    [transport.options]               # passed to the transport as-is

    [http]                            # health and Prometheus metrics
    enabled = true
    host = "127.0.0.1"
    port = 9500                       # GET /health, GET /metrics

Every key can be overridden by environment: ``WALTZ_STORAGE__DATA_DIR``,
``WALTZ_TRANSPORT__ENDPOINT``, ``WALTZ_LOG_LEVEL``...
"""

from __future__ import annotations

import math
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from waltz_api.config import load_config
from waltz_api.errors import ConfigError
from waltz_api.http_endpoint import HttpSection
from waltz_api.process import log_format_field, log_level_field

DEFAULT_SCRUB_RATE = 4 * 1024 * 1024
DEFAULT_SCRUB_INTERVAL = 24 * 3600.0


@dataclass
class ScrubSection:
    """Background scrubbing (``[storage.scrub]``): the node reads back the sealed records
    of its partitions and verifies them, so that damage is found and repaired from a peer
    before a read needs the record (engines with the ``scrub`` capability)."""

    enabled: bool = field(
        default=True,
        metadata={"help": "read back and verify the sealed records in the background"},
    )
    rate_bytes_per_second: int = field(
        default=DEFAULT_SCRUB_RATE,
        metadata={"help": "most record bytes the background scrub reads per second (>= 1)"},
    )
    interval: float = field(
        default=DEFAULT_SCRUB_INTERVAL,
        metadata={
            "help": "seconds from the start of one pass over every hosted partition to the "
            "start of the next (a longer pass is followed at once; >= 0)"
        },
    )

    def __post_init__(self) -> None:
        if isinstance(self.rate_bytes_per_second, bool) or self.rate_bytes_per_second < 1:
            raise ConfigError(
                "config key 'storage.scrub.rate_bytes_per_second' must be a number of bytes "
                f"of at least 1, got {self.rate_bytes_per_second!r} (to stop scrubbing, set "
                "storage.scrub.enabled = false)",
                "storage.scrub.rate_bytes_per_second",
            )
        if not math.isfinite(self.interval) or self.interval < 0:
            raise ConfigError(
                "config key 'storage.scrub.interval' must be a number of seconds of at least "
                f"0, got {self.interval!r}",
                "storage.scrub.interval",
            )


@dataclass
class StorageSection:
    data_dir: str = field(metadata={"help": "where the storage engine keeps its data"})
    engine: str = field(default="fs", metadata={"help": "storage engine plugin name"})
    cluster_key: str | None = field(
        default=None,
        metadata={"help": "the cluster's key (UUID); required to create a new data dir"},
    )
    num_partitions: int | None = field(
        default=None,
        metadata={
            "min": 1,
            "help": "the cluster's number of partitions; required for a new data dir",
        },
    )
    partitions: list[int] = field(
        default_factory=list,
        metadata={"help": "partitions to host from start-up (added when missing)"},
    )
    options: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "storage engine options, passed as-is"}
    )
    queue_size: int = field(
        default=1000,
        metadata={"min": 1, "help": "requests queued per partition before a sender waits"},
    )
    queue_bytes: int = field(
        default=64 * 1024 * 1024,
        metadata={"min": 1, "help": "request bytes queued per partition before a sender waits"},
    )
    max_append_batch_records: int = field(
        default=10000,
        metadata={"min": 1, "help": "most records handed to the engine in one append"},
    )
    max_list_records: int = field(
        default=10000,
        metadata={"min": 1, "help": "most records or headers in one list response"},
    )
    scrub: ScrubSection = field(
        default_factory=ScrubSection,
        metadata={"help": "background scrubbing of the sealed records"},
    )

    def __post_init__(self) -> None:
        if not self.data_dir.strip():
            raise ConfigError("config key 'storage.data_dir' must not be empty", "storage.data_dir")
        if not self.engine.strip():
            raise ConfigError(
                "config key 'storage.engine' must name a storage engine plugin (e.g. 'fs')",
                "storage.engine",
            )
        if self.cluster_key is not None:
            try:
                uuid.UUID(self.cluster_key)
            except ValueError:
                raise ConfigError(
                    f"config key 'storage.cluster_key' must be a UUID, got {self.cluster_key!r}; "
                    "copy the key printed by `waltz cluster create`",
                    "storage.cluster_key",
                ) from None
        for index, partition_id in enumerate(self.partitions):
            if partition_id < 0 or (
                self.num_partitions is not None and partition_id >= self.num_partitions
            ):
                bound = f"below {self.num_partitions}" if self.num_partitions else "non-negative"
                raise ConfigError(
                    f"config key 'storage.partitions[{index}]' must be {bound}, got {partition_id}",
                    f"storage.partitions[{index}]",
                )

    @property
    def cluster_uuid(self) -> uuid.UUID | None:
        return None if self.cluster_key is None else uuid.UUID(self.cluster_key)


@dataclass
class TransportSection:
    endpoint: str = field(metadata={"help": "the endpoint the node listens on"})
    plugin: str = field(default="zmq", metadata={"help": "transport plugin name"})
    options: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "transport options, passed as-is"}
    )

    def __post_init__(self) -> None:
        if not self.endpoint.strip():
            raise ConfigError(
                "config key 'transport.endpoint' must not be empty (e.g. 'tcp://127.0.0.1:5500')",
                "transport.endpoint",
            )


@dataclass
class StorageNodeConfig:
    storage: StorageSection
    transport: TransportSection
    http: HttpSection = field(default_factory=HttpSection)
    log_level: str = log_level_field()
    log_format: str = log_format_field()


def load_storage_config(
    path: str | os.PathLike[str] | None,
    *,
    env: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> StorageNodeConfig:
    """Read and validate a storage node config file (plus ``WALTZ_*`` overrides)."""
    return load_config(StorageNodeConfig, path, env=env, overrides=overrides)
