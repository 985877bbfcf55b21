"""Cluster feature levels: which formats and messages a cluster may use.

A format or protocol change that a process of the previous release cannot read is
written only once the cluster's recorded *feature level* allows it (Kafka's
``metadata.version``): storage nodes and servers of a new release keep writing and
speaking what the previous release understands until an operator raises the level with
``waltz cluster features --raise``, which first checks that every storage node and
every live server supports the new level. So a process rolled back before that can
still read everything; the level is never lowered (docs/compatibility.md, "Feature
levels").

The level is recorded in the coordination metadata (``/cluster/features``, a value of
type ``feature_level``, :mod:`waltz_api.cluster`); a cluster without it was created by
0.1.0 and is at level 1. ``waltz cluster create`` records :data:`MAX_FEATURE_LEVEL`.

:data:`FEATURE_LEVELS` is the one table of what each level enables (docs/compatibility.md
repeats it; a test keeps them in step).
"""

from __future__ import annotations

from dataclasses import dataclass

from waltz_api.errors import ConfigError


@dataclass(frozen=True, slots=True)
class FeatureLevel:
    """One level: the release that introduced it (``unreleased`` until the release
    process names it) and what it lets processes write."""

    level: int
    release: str
    enables: tuple[str, ...]


FEATURE_LEVELS: tuple[FeatureLevel, ...] = (
    FeatureLevel(
        1,
        "0.1.0",
        (
            "fs storage control file format 2",
            "wire protocol 1 without MarkReplicaRequest",
        ),
    ),
    FeatureLevel(
        2,
        "unreleased",
        (
            "fs storage control file format 3 (each partition's acknowledged end: "
            "the lost-tail check)",
            "MarkReplicaRequest (type 71: a replica that lost what it acknowledged "
            "is marked suspect on its storage)",
        ),
    ),
    FeatureLevel(
        3,
        "unreleased",
        (
            "fs storage control file format 4 (the node journal: one durable round "
            "per storage node)",
        ),
    ),
)
"""Every level, ascending. Not gated by a level (turned on by configuration only once
every process runs the release that reads them): the archive's marks and files
(``[server.archive]``, docs/archive.md)."""

MIN_FEATURE_LEVEL = FEATURE_LEVELS[0].level
"""The level of a cluster that records none (created by 0.1.0), and of a process that
reports none."""
MAX_FEATURE_LEVEL = FEATURE_LEVELS[-1].level
"""The highest level this code supports (and records when it creates a cluster)."""

MARK_REPLICA_LEVEL = 2
"""From this level on a server sends MarkReplicaRequest."""


def feature_level(level: int) -> FeatureLevel:
    """The table's entry for ``level`` (ConfigError naming the known levels otherwise)."""
    for entry in FEATURE_LEVELS:
        if entry.level == level:
            return entry
    raise ConfigError(
        f"feature level {level!r} is not one this Waltz knows "
        f"({MIN_FEATURE_LEVEL}..{MAX_FEATURE_LEVEL}); a newer Waltz may know it: upgrade",
        key="feature_level",
    )


def check_feature_level(level: object, what: str = "feature level") -> int:
    """``level`` as a known level (ConfigError otherwise)."""
    if isinstance(level, bool) or not isinstance(level, int):
        raise ConfigError(f"{what} must be an integer, got {level!r}", key="feature_level")
    return feature_level(level).level


__all__ = [
    "FEATURE_LEVELS",
    "MARK_REPLICA_LEVEL",
    "MAX_FEATURE_LEVEL",
    "MIN_FEATURE_LEVEL",
    "FeatureLevel",
    "check_feature_level",
    "feature_level",
]
