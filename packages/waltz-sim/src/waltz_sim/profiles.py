"""The fault profiles (``waltz simulate --faults``): what each injects, how often, and
what else it changes in a run. The faults themselves are :mod:`waltz_sim.faults`'s (the
nemesis) and :mod:`waltz_sim.storage_faults`'s; this module is plain data, so the world
reads a profile without importing the nemesis."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from waltz_api.errors import ConfigError

STORAGE_WEIGHTS = {
    "lost_write": 2.0,
    "corruption": 2.0,
    "misdirected_write": 1.0,
    "read_error": 1.0,
    "wiped_disk": 1.0,
    "stale_restore": 1.0,
    "power_loss": 1.0,
    "damaged_rejoin": 4.0,
}
"""The disk faults of the ``storage`` profile (``power_loss`` tears the last write)."""


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    weights: dict[str, float]
    gap: tuple[float, float] = (1.0, 3.0)
    """Seconds between two faults of the safety phase."""
    quorum_faults: tuple[str, ...] = ()
    """Faults of the quorum phase (one is chosen); none: no quorum phase."""
    point_strikes: bool = False
    """Crash or pause processes at protocol points (``waltz_sim.points``)."""
    server_options: Mapping[str, object] = field(default_factory=dict)
    """``[server]`` keys of the profile's runs (a run's own ``server_options`` win)."""
    client_flushes: float = 0.0
    """Per client, the mean rate (per second) of its ``flush()`` calls, on a partition
    chosen at random: flush rounds among appends in flight (0: none)."""


_NETWORK = {"partition": 3.0, "isolate": 1.0, "slow_link": 2.0, "reset": 2.0}
_DISK = {"power_loss": 2.0, "slow_fsync": 2.0, "fsync_error": 1.5, "damage": 1.0}
_PROCESS = {"crash": 3.0, "pause": 2.0}
_COORDINATION = {
    "expire_session": 1.5,
    "coordination_outage": 1.0,
    "slow_watches": 1.5,
    "zombie": 2.0,
}
_QUORUM = (
    "storage_majority_down",
    "storage_power_cut",
    "servers_down",
    "long_coordination_outage",
    "storage_cut_off",
    "storage_majority_paused",
)

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("none", "no faults at all (the baseline)", {}),
        Profile(
            "mild",
            "slow links, connection resets, and now and then a crash and restart",
            {"slow_link": 2.0, "reset": 2.0, "crash": 1.0, "slow_fsync": 1.0},
            gap=(3.0, 6.0),
        ),
        Profile(
            "network",
            "partitions (asymmetric too), isolated processes, slow links, resets",
            _NETWORK,
            quorum_faults=("storage_cut_off",),
        ),
        Profile(
            "disk",
            "power losses (unsynced writes lost, last write torn), slow and failing fsyncs",
            {**_DISK, "crash": 1.0},
            quorum_faults=("storage_power_cut", "storage_majority_down"),
        ),
        Profile(
            "process",
            "crashes and restarts, pauses (SIGSTOP) of servers, storage nodes and clients",
            {**_PROCESS, "power_loss": 1.0},
            quorum_faults=("servers_down", "storage_majority_down", "storage_majority_paused"),
        ),
        Profile(
            "coordination",
            "session expiries, coordination outages, slow watches, cuts from coordination",
            {**_COORDINATION, "partition": 1.0},
            quorum_faults=("long_coordination_outage",),
        ),
        Profile(
            "standard",
            "every fault: network, disk, process and coordination, then a quorum break",
            {**_NETWORK, **_DISK, **_PROCESS, **_COORDINATION},
            quorum_faults=_QUORUM,
        ),
        Profile(
            "points",
            "protocol-timed faults: crashes and pauses exactly at protocol points (a replica's "
            "rejoin, a recovery's vote, a session opening...), among slow fsyncs, damaged "
            "disks, pauses and network faults that leave a slow but live quorum",
            {
                **_NETWORK,
                **_PROCESS,
                "slow_fsync": 3.0,
                "damage": 1.0,
                "damage_lagging": 3.0,
                "power_loss": 1.0,
                "zombie": 1.0,
            },
            gap=(1.5, 4.0),
            point_strikes=True,
            client_flushes=0.2,
            # tiny batches and window: a slow replica falls behind what is in flight to
            # it (as one thousands of records behind does on a busy cluster) and catches
            # up from a healthy replica's storage;
            # and a checkpoint interval that is reached: store sessions roll over
            server_options={
                "max_batch_records": 2,
                "max_window_bytes": 1024,
                "checkpoint_interval": 60,
            },
        ),
        Profile(
            "storage",
            "what disks do to acknowledged records (lost, corrupt, misdirected, unreadable, "
            "torn; wiped and stale disks) with lagging replicas and owner crashes",
            {
                **STORAGE_WEIGHTS,
                "slow_fsync": 3.0,
                "owner_crash": 2.0,
                "crash": 1.0,
                "pause": 1.0,
                "slow_link": 1.0,
            },
            gap=(0.7, 2.0),
            quorum_faults=("storage_power_cut", "storage_majority_down", "servers_down"),
        ),
        Profile(
            "chaos",
            "every fault, three times as often",
            {**_NETWORK, **_DISK, **_PROCESS, **_COORDINATION},
            gap=(0.5, 1.5),
            quorum_faults=_QUORUM,
        ),
    )
}


def profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ConfigError(
            f"unknown fault profile {name!r}; choose one of {', '.join(PROFILES)}", key="faults"
        ) from None


__all__ = ["PROFILES", "STORAGE_WEIGHTS", "Profile", "profile"]
