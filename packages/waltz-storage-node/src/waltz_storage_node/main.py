"""Running a storage node from its config file (``waltz storage --config storage.toml``)."""

from __future__ import annotations

import asyncio
import logging
import os
import typing

from waltz_api.capabilities import SCRUB
from waltz_api.contracts.storage import StorageEngine
from waltz_api.contracts.transport import Transport
from waltz_api.errors import (
    ClusterKeyMismatchError,
    ConfigError,
    PluginError,
    StorageError,
)
from waltz_api.features import MIN_FEATURE_LEVEL
from waltz_api.http_endpoint import HttpEndpoint
from waltz_api.plugins import get_registry
from waltz_api.process import run_until_signalled
from waltz_storage_node.config import StorageNodeConfig, load_storage_config
from waltz_storage_node.http import metrics_for, storage_node_endpoint
from waltz_storage_node.node import StorageNode
from waltz_storage_node.scrub import Scrubber

log = logging.getLogger(__name__)


async def open_engine(config: StorageNodeConfig) -> StorageEngine:
    """Open (or create) the configured storage engine and host the configured partitions."""
    section = config.storage
    try:
        descriptor = get_registry().get("storage", section.engine)
    except PluginError as exc:
        raise ConfigError(f"config key 'storage.engine': {exc}", "storage.engine") from None
    engine_class = typing.cast(type[StorageEngine], descriptor.factory)
    try:
        engine = await engine_class.open(
            section.data_dir,
            cluster_key=section.cluster_uuid,
            num_partitions=section.num_partitions,
            options=section.options,
            # new storage starts at level 1 (a node of 0.1.0 reads it); the cluster
            # tools and the servers raise it to the cluster's level (admin command
            # set_feature_level), and the engine keeps it
            feature_level=MIN_FEATURE_LEVEL,
        )
    except ClusterKeyMismatchError as exc:
        raise ConfigError(
            f"config key 'storage.cluster_key' (or 'storage.num_partitions') does not match "
            f"the storage at {section.data_dir}: {exc}",
            "storage.cluster_key",
        ) from exc
    except StorageError as exc:
        if section.cluster_key is None or section.num_partitions is None:
            missing = (
                "storage.cluster_key" if section.cluster_key is None else "storage.num_partitions"
            )
            raise ConfigError(
                f"could not open the storage at {section.data_dir}: {exc}; to create a new "
                f"storage, set config keys 'storage.cluster_key' and 'storage.num_partitions'",
                missing,
            ) from exc
        raise
    try:
        for partition_id in section.partitions:
            if partition_id >= engine.num_partitions:
                raise ConfigError(
                    f"config key 'storage.partitions' lists partition {partition_id}, but the "
                    f"storage at {section.data_dir} has {engine.num_partitions} partitions",
                    "storage.partitions",
                )
            if partition_id not in engine.partition_ids():
                await engine.add_partition(partition_id)
    except BaseException:
        await engine.close()
        raise
    return engine


def create_transport(config: StorageNodeConfig) -> Transport:
    try:
        descriptor = get_registry().get("transport", config.transport.plugin)
    except PluginError as exc:
        raise ConfigError(f"config key 'transport.plugin': {exc}", "transport.plugin") from None
    transport: Transport = descriptor.factory(config.transport.options)
    return transport


def engine_capabilities(config: StorageNodeConfig) -> frozenset[str]:
    """The optional features the configured engine's plugin declares."""
    return frozenset(get_registry().get("storage", config.storage.engine).capabilities)


async def start_node(config: StorageNodeConfig) -> StorageNode:
    """Open the engine, create the transport and start listening (and scrubbing)."""
    engine = await open_engine(config)
    try:
        transport = create_transport(config)
    except BaseException:
        await engine.close()
        raise
    metrics = metrics_for(config.http)
    if metrics is not None and hasattr(engine, "fsync_observer"):
        # engines that can time their flush alone report it (the fs engine does)
        engine.fsync_observer = metrics.observe_fsync
    node = StorageNode(
        engine,
        transport,
        config.transport.endpoint,
        queue_size=config.storage.queue_size,
        queue_bytes=config.storage.queue_bytes,
        max_append_batch_records=config.storage.max_append_batch_records,
        max_list_records=config.storage.max_list_records,
        metrics=metrics,
        capabilities=engine_capabilities(config),
    )
    scrub = config.storage.scrub
    if scrub.enabled and SCRUB in node.capabilities:
        node.scrubber = Scrubber(
            node, rate_bytes_per_second=scrub.rate_bytes_per_second, interval=scrub.interval
        )
    elif scrub.enabled:
        log.info(
            "storage engine %r does not scrub (no 'scrub' capability): damage is found when "
            "a record is read, or at start-up",
            config.storage.engine,
        )
    try:
        await node.start()
    except BaseException:
        await node.close()
        await transport.close()
        raise
    return node


async def serve(config: StorageNodeConfig, stop: asyncio.Event) -> None:
    """Run a node until ``stop`` is set, then shut it down cleanly."""
    node = await start_node(config)
    http: HttpEndpoint | None = None
    try:
        if config.http.enabled:
            http = storage_node_endpoint(config.http, node, config.storage.data_dir)
            await http.start()
        # A supervisor (or a test) waiting for the node reads this line on stderr.
        log.info("storage node ready on %s (pid %d)", node.endpoint, os.getpid())
        await stop.wait()
    finally:
        log.info("storage node shutting down")
        if http is not None:
            await http.close()
        await node.close()
        await node.transport.close()


def run_from_config(path: str | os.PathLike[str] | None) -> None:
    """Load the config, run the storage node until SIGINT or SIGTERM, and stop cleanly.

    Raises :class:`~waltz_api.errors.ConfigError` (naming the key) on a bad
    config and other :class:`~waltz_api.errors.WaltzError` when the storage
    cannot be opened or the endpoint bound.
    """
    config = load_storage_config(path)
    run_until_signalled(
        lambda stop: serve(config, stop),
        log_level=config.log_level,
        log_format=config.log_format,
        what="storage node",
    )
