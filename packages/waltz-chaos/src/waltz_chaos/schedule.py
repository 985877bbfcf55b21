"""The fault schedule: which fault, when, on what, for how long - drawn from a seed.

A schedule is a pure function of the seed, the cluster's shape (its roles), the
run's length, the profile and what the machine allows (network namespaces, small
file systems): the same inputs draw the same schedule. It is written to
``schedule.json`` in the run directory; ``waltz chaos --schedule FILE`` replays a
schedule file as it is, whatever the generator draws today.

A run has phases, like the simulation's (docs/simulation.md):

- *warm-up* (:data:`WARM_UP` s): no faults;
- *faults*: one after another (``gap`` seconds apart, overlapping), under rules that
  keep the cluster able to commit: at most a minority of the storage nodes impaired
  at once (killed, paused, its disk full, or cut off or slowed from a server), at
  least one server unimpaired (killed, paused, its session expiring, or cut off from
  coordination), one coordination fault at a time, one fault at a time per process
  and per direction of a link;
- *quorum* (profiles with quorum faults): one fault that breaks a quorum (a majority
  of the storage nodes killed or paused, every server killed, a coordination outage
  longer than the session timeout, the servers cut off from a majority of the
  storage nodes), held 3 to 6 s, with no other fault; long runs have one every
  :data:`QUORUM_EVERY` seconds;
- *quiet*: the rest of the run, no faults: every fault healed, the liveness bounds run.

*Storage faults* (:data:`STORAGE_FAULTS`, the ``storage`` profile) damage what a
storage node holds: while it is stopped (bytes of a segment corrupted, a segment's
tail cut, its data directory rolled back to an earlier copy or wiped) or while it runs
(bytes of a sealed segment flipped, found only when read, or by a scrub). The node is
impaired from the injection until the cluster has repaired it, and a fault's ``hold``
is when the nemesis restarts it (or, running, scrubs it); the schedule counts
:data:`REPAIR_ALLOWANCE` seconds for the repair after that, and the nemesis holds back
any fault that would impair another storage node while the repair lasts longer
(:mod:`waltz_chaos.nemesis`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from waltz_chaos.errors import ChaosError

WARM_UP = 5.0
QUORUM_HOLD = (3.0, 6.0)
QUORUM_RECOVERY = 12.0
"""Seconds without faults after a quorum fault heals (the cluster recovers, the
liveness bounds run in that quiet period)."""
QUORUM_EVERY = 300.0
SCHEDULE_VERSION = 1
REPAIR_ALLOWANCE = 5.0
"""Seconds a storage fault's schedule counts for the repair, after the node's restart."""

STOPPED_STORAGE_FAULTS = ("corrupt_segment", "truncate_segment", "rollback_data", "wipe_data")
"""Storage faults done to a node's files while it is stopped (killed -9, restarted at
the fault's ``hold``)."""
STORAGE_FAULTS = (*STOPPED_STORAGE_FAULTS, "flip_sealed")
"""Faults that damage what a storage node holds: impaired until the cluster repaired it."""
STOPPING_FAULTS = ("kill", "storage_majority_down", *STOPPED_STORAGE_FAULTS)
"""Faults that stop a storage node (its data directory is copied then, for a rollback)."""
PROCESS_FAULTS = ("kill", "pause", "disk_full", "session_expiry", "isolate", *STORAGE_FAULTS)
"""Faults that act on a process (one at a time per process)."""
LINK_FAULTS = ("partition", "one_way", "slow_link", "lossy_link")
NETWORK_FAULTS = (*LINK_FAULTS, "isolate", "storage_cut_off")
QUORUM_FAULTS = (
    "storage_majority_down",
    "storage_majority_paused",
    "servers_down",
    "long_coordination_outage",
    "storage_cut_off",
)

FAULT_DESCRIPTIONS: dict[str, str] = {
    "kill": "kill -9 a storage node, server or client; restarted when the fault ends",
    "pause": "SIGSTOP a storage node, server or client; SIGCONT when the fault ends",
    "coordination_restart": "kill -9 the coordination service; restarted on its data",
    "session_expiry": "a server's or client's coordination session expires (cut off from "
    "coordination longer than the session timeout; without namespaces: paused that long)",
    "disk_full": "a storage node's file system fills up (a filler file takes every free "
    "byte); the node is restarted if its engine closed a partition",
    "partition": "the link between two roles cut both ways",
    "one_way": "one direction of a link cut (asymmetric partition)",
    "isolate": "a role cut off from every other",
    "slow_link": "a link delayed (netem) or rate limited (tbf) both ways",
    "lossy_link": "a link dropping 10 to 40% of its packets both ways",
    "storage_majority_down": "quorum: a majority of the storage nodes killed",
    "storage_majority_paused": "quorum: a majority of the storage nodes paused",
    "servers_down": "quorum: every server killed",
    "long_coordination_outage": "quorum: coordination down longer than the session timeout",
    "storage_cut_off": "quorum: the servers cut off from a majority of the storage nodes",
    "corrupt_segment": "bytes of a segment of a stopped storage node corrupted (found at its "
    "start: a hole or a lost tail, repaired from the other replicas)",
    "truncate_segment": "the tail of a stopped storage node's newest segment cut (records it "
    "acknowledged lost without a trace)",
    "rollback_data": "a stopped storage node's data directory rolled back to a copy taken at "
    "an earlier stop",
    "wipe_data": "a stopped storage node's data directory wiped (a new disk)",
    "flip_sealed": "bytes of a sealed segment of a running storage node flipped (found when "
    "read); a scrub pass on the node at the heal finds the damage",
}


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    weights: Mapping[str, float]
    gap: tuple[float, float] = (0.8, 2.4)
    quorum: tuple[str, ...] = QUORUM_FAULTS


_PROCESS = {"kill": 3.0, "pause": 2.0, "coordination_restart": 1.0, "disk_full": 1.0}
_NETWORK = {
    "partition": 2.5,
    "one_way": 1.5,
    "isolate": 1.0,
    "slow_link": 1.5,
    "lossy_link": 1.0,
    "session_expiry": 1.0,
}

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            "standard",
            "every fault (process, disk, coordination, network)",
            {**_PROCESS, **_NETWORK},
        ),
        Profile(
            "process",
            "kills, pauses, coordination restarts, full disks, session expiries",
            {**_PROCESS, "session_expiry": 1.0},
            quorum=("storage_majority_down", "storage_majority_paused", "servers_down"),
        ),
        Profile(
            "network",
            "partitions (asymmetric too), isolation, slow and lossy links, session expiries",
            _NETWORK,
            quorum=("storage_cut_off",),
        ),
        Profile(
            "mild",
            "the standard faults, further apart, no quorum break",
            {**_PROCESS, **_NETWORK},
            gap=(3.0, 8.0),
            quorum=(),
        ),
        Profile(
            "storage",
            "storage faults (corrupt, truncated, rolled back or wiped data; bit flips in "
            "sealed segments), with kills and pauses",
            {**dict.fromkeys(STORAGE_FAULTS, 2.0), "kill": 2.0, "pause": 1.0},
            quorum=(),
        ),
        Profile("none", "no faults (the baseline)", {}, quorum=()),
    )
}


@dataclass(frozen=True)
class Roles:
    """The cluster's shape, as the schedule sees it."""

    storage: tuple[str, ...]
    servers: tuple[str, ...]
    clients: tuple[str, ...]
    coordination: str = "coordination"

    @classmethod
    def of(cls, storage: int, servers: int, clients: int) -> Roles:
        return cls(
            tuple(f"storage-{i}" for i in range(storage)),
            tuple(f"server-{i}" for i in range(servers)),
            tuple(f"client-{i}" for i in range(clients)),
        )

    @property
    def all(self) -> tuple[str, ...]:
        return (self.coordination, *self.storage, *self.servers, *self.clients)

    def links(self) -> list[tuple[str, str]]:
        """Every pair of roles that talk (the faultable links; ``admin`` comes on top)."""
        pairs: list[tuple[str, str]] = []
        for server in self.servers:
            pairs.append((server, self.coordination))
            pairs += [(server, storage) for storage in self.storage]
            pairs += [(server, other) for other in self.servers if other > server]
        for client in self.clients:
            pairs.append((client, self.coordination))
            pairs += [(client, server) for server in self.servers]
        return pairs

    def to_json(self) -> dict[str, Any]:
        return {
            "storage": list(self.storage),
            "servers": list(self.servers),
            "clients": list(self.clients),
            "coordination": self.coordination,
        }


@dataclass(frozen=True)
class Fault:
    """One fault of the schedule."""

    at: float
    """Seconds after the start of the workload."""
    kind: str
    duration: float
    targets: tuple[str, ...] = ()
    """The processes it acts on (kill, pause, disk_full, session_expiry, isolate, quorum)."""
    links: tuple[tuple[str, str], ...] = ()
    """The directions of links it acts on, (sender, receiver)."""
    delay_ms: int = 0
    rate_kbit: int = 0
    loss: float = 0.0
    hold: float = 0.0
    """Storage faults: seconds from the injection to the node's restart (the rest of the
    duration is counted for its repair)."""

    @property
    def end(self) -> float:
        return self.at + self.duration

    @property
    def heal_at(self) -> float:
        """When the nemesis heals it: a storage fault's restart, else its end."""
        return self.at + self.hold if self.kind in STORAGE_FAULTS else self.end

    @property
    def quorum(self) -> bool:
        return self.kind in QUORUM_FAULTS

    @property
    def network(self) -> bool:
        return self.kind in NETWORK_FAULTS

    def links_text(self) -> str:
        """``a<->b`` for a link faulted both ways, ``a->b`` for one direction."""
        return _describe_links(self.links)

    def describe(self) -> str:
        if self.links and self.kind != "isolate":
            pairs = self.links_text()
            what = {
                "partition": "cut",
                "one_way": "cut one way",
                "slow_link": "slow" if not self.delay_ms else f"+{self.delay_ms} ms",
                "lossy_link": f"{self.loss:.0%} loss",
                "storage_cut_off": "cut",
            }.get(self.kind, self.kind)
            return f"{self.kind}: {pairs} {what}"
        return f"{self.kind}: {', '.join(self.targets)}"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["targets"] = list(self.targets)
        data["links"] = [list(link) for link in self.links]
        return {k: v for k, v in data.items() if v not in (0, 0.0, [], ())} | {
            "at": self.at,
            "kind": self.kind,
            "duration": self.duration,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Fault:
        try:
            return cls(
                at=float(data["at"]),
                kind=str(data["kind"]),
                duration=float(data["duration"]),
                targets=tuple(str(t) for t in data.get("targets", ())),
                links=tuple((str(a), str(b)) for a, b in data.get("links", ())),
                delay_ms=int(data.get("delay_ms", 0)),
                rate_kbit=int(data.get("rate_kbit", 0)),
                loss=float(data.get("loss", 0.0)),
                hold=float(data.get("hold", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ChaosError(f"malformed fault {dict(data)!r} in the schedule: {exc}") from None


def _describe_links(links: Sequence[tuple[str, str]]) -> str:
    seen: list[str] = []
    directed = set(links)
    for a, b in links:
        text = f"{min(a, b)}<->{max(a, b)}" if (b, a) in directed else f"{a}->{b}"
        if text not in seen:
            seen.append(text)
    return ", ".join(seen)


@dataclass
class Schedule:
    seed: int
    duration: float
    """Seconds of workload (the faults, then the quiet end)."""
    quiet: float
    """Seconds at the end without faults."""
    profile: str
    roles: Roles
    faults: list[Fault] = field(default_factory=list)

    @property
    def heal_deadline(self) -> float:
        return self.duration - self.quiet

    def to_json(self) -> dict[str, Any]:
        return {
            "version": SCHEDULE_VERSION,
            "seed": self.seed,
            "duration": self.duration,
            "quiet": self.quiet,
            "profile": self.profile,
            "roles": self.roles.to_json(),
            "faults": [f.to_json() for f in self.faults],
        }

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Schedule:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ChaosError(f"cannot read the schedule {path}: {exc}") from None
        if not isinstance(data, dict) or data.get("version") != SCHEDULE_VERSION:
            raise ChaosError(
                f"{path} is not a waltz chaos schedule (version {SCHEDULE_VERSION} expected)"
            )
        try:
            raw = data["roles"]
            roles = Roles(
                tuple(raw["storage"]),
                tuple(raw["servers"]),
                tuple(raw["clients"]),
                raw["coordination"],
            )
            return cls(
                seed=int(data["seed"]),
                duration=float(data["duration"]),
                quiet=float(data["quiet"]),
                profile=str(data["profile"]),
                roles=roles,
                faults=[Fault.from_json(f) for f in data["faults"]],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ChaosError(f"malformed schedule {path}: {exc}") from None

    def kinds(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for fault in self.faults:
            counts[fault.kind] = counts.get(fault.kind, 0) + 1
        return counts

    def check_fits(
        self,
        roles: Roles,
        *,
        network: bool,
        disk: bool,
        coordination: bool = True,
        eligible: Collection[str] | None = None,
        data: bool = True,
    ) -> None:
        """Refuse a (loaded) schedule this cluster cannot play (``data``: the run reaches
        the storage nodes' data directories)."""
        known = set(roles.all)
        for fault in self.faults:
            if eligible is not None and not set(fault.targets) <= set(eligible) | {
                roles.coordination
            }:
                raise ChaosError(
                    f"the schedule's fault at {fault.at:.1f} s acts on "
                    f"{sorted(set(fault.targets) - set(eligible))}, which this run may not touch "
                    "(name their pids with --process ROLE=PID)"
                )
            if (
                fault.kind in ("coordination_restart", "long_coordination_outage")
                and not coordination
            ):
                raise ChaosError(
                    f"the schedule restarts the coordination service ({fault.describe()}), "
                    "which this run did not start"
                )
            named = set(fault.targets) | {r for link in fault.links for r in link}
            if not named <= known:
                raise ChaosError(
                    f"the schedule's fault at {fault.at:.1f} s names {sorted(named - known)}, "
                    f"which this cluster does not have (it has {', '.join(roles.all)}): run "
                    "with the cluster shape of the schedule (--storage-nodes, --servers, "
                    "--clients)"
                )
            if fault.network and not network:
                raise ChaosError(
                    f"the schedule has network faults ({fault.describe()}) but this run has no "
                    "network namespaces (run as root, with iproute2)"
                )
            if fault.kind == "disk_full" and not disk:
                raise ChaosError(
                    "the schedule has disk_full faults but this run cannot mount small file "
                    "systems (run as root)"
                )
            if fault.kind in STORAGE_FAULTS and not data:
                raise ChaosError(
                    f"the schedule has storage faults ({fault.describe()}) but this run cannot "
                    "reach the storage nodes' data directories (an attached cluster)"
                )
            if fault.end > self.duration:
                raise ChaosError(f"the schedule's fault at {fault.at:.1f} s ends after the run")


def profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ChaosError(
            f"unknown fault profile {name!r}; choose one of {', '.join(PROFILES)} "
            f"or a comma-separated list of faults ({', '.join(FAULT_DESCRIPTIONS)})"
        ) from None


def profile_of(spec: str) -> Profile:
    """A profile by name, or one made of a comma-separated list of fault kinds."""
    if spec in PROFILES:
        return PROFILES[spec]
    kinds = [k.strip() for k in spec.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in FAULT_DESCRIPTIONS]
    if not kinds or unknown:
        return profile(spec)
    regular = {k: 1.0 for k in kinds if k not in QUORUM_FAULTS}
    return Profile(
        spec,
        f"only {', '.join(kinds)}",
        regular,
        quorum=tuple(k for k in kinds if k in QUORUM_FAULTS),
    )


class _Generator:
    def __init__(
        self,
        rng: random.Random,
        roles: Roles,
        *,
        network: bool,
        disk: bool,
        session_timeout: float,
        coordination: bool = True,
        eligible: Collection[str] | None = None,
        data: bool = True,
    ) -> None:
        self.rng = rng
        self.roles = roles
        self.network = network
        self.disk = disk
        self.coordination = coordination
        self.data = data
        self.session_timeout = session_timeout
        self.eligible = set(roles.all if eligible is None else eligible)
        self.placed: list[Fault] = []

    def _pool(self, *groups: Sequence[str]) -> list[str]:
        return [r for group in groups for r in group if r in self.eligible]

    def available(self, kind: str) -> bool:
        roles = self.roles
        majority = len(roles.storage) // 2 + 1
        if kind in NETWORK_FAULTS and not self.network:
            return False
        if kind == "disk_full" and not self.disk:
            return False
        if kind in ("coordination_restart", "long_coordination_outage") and not self.coordination:
            return False
        if kind in STORAGE_FAULTS:
            return self.data and bool(self._pool(roles.storage))
        if kind in ("storage_majority_down", "storage_majority_paused"):
            return len(self._pool(roles.storage)) >= majority
        if kind == "servers_down":
            return bool(roles.servers) and len(self._pool(roles.servers)) == len(roles.servers)
        if kind in ("kill", "pause"):
            return bool(self._pool(roles.storage, roles.servers, roles.clients))
        if kind == "session_expiry":
            return bool(self._pool(roles.servers, roles.clients))
        if kind in ("disk_full", "isolate"):
            return bool(self._pool(roles.storage)) or (
                kind == "isolate" and bool(self._pool(roles.servers))
            )
        return True

    # -- drawing one fault ----------------------------------------------------------------

    def draw(self, kind: str, at: float, limit: float) -> Fault | None:
        rng, roles = self.rng, self.roles
        processes = self._pool(roles.storage, roles.servers, roles.clients)

        def span(low: float, high: float) -> float:
            return round(min(rng.uniform(low, high), max(0.5, limit - at)), 3)

        at = round(at, 3)
        if kind == "kill":
            return Fault(at, kind, span(1.0, 6.0), (rng.choice(processes),))
        if kind == "pause":
            return Fault(at, kind, span(1.0, 5.0), (rng.choice(processes),))
        if kind == "coordination_restart":
            return Fault(at, kind, span(1.0, 4.0), (roles.coordination,))
        if kind == "session_expiry":
            target = rng.choice(self._pool(roles.servers, roles.clients))
            hold = self.session_timeout * 1.5 + rng.uniform(0.5, 1.5)
            if at + hold > limit:
                return None
            return Fault(at, kind, round(hold, 3), (target,))
        if kind == "disk_full":
            return Fault(at, kind, span(2.0, 6.0), (rng.choice(self._pool(roles.storage)),))
        if kind == "isolate":
            duration = span(1.0, 6.0)  # (drawn before the target: a seed's schedule stays)
            return Fault(
                at, kind, duration, (rng.choice(self._pool(roles.storage, roles.servers)),)
            )
        if kind in STORAGE_FAULTS:
            return self._draw_storage(kind, at, limit)
        if kind in LINK_FAULTS:
            a, b = self._pair()
            links: tuple[tuple[str, str], ...] = ((a, b), (b, a))
            if kind == "one_way":
                links = (rng.choice(links),)
            duration = span(1.0, 8.0) if kind in ("partition", "one_way") else span(2.0, 8.0)
            fault = Fault(at, kind, duration, links=links)
            if kind == "slow_link":
                fault = Fault(
                    at,
                    kind,
                    duration,
                    links=links,
                    delay_ms=rng.choice((50, 100, 200, 400)),
                    rate_kbit=rng.choice((32, 64, 128)),
                )
            if kind == "lossy_link":
                fault = Fault(
                    at, kind, duration, links=links, loss=rng.choice((0.1, 0.2, 0.3, 0.4))
                )
            return fault
        hold = span(*QUORUM_HOLD)
        majority = len(roles.storage) // 2 + 1
        if kind in ("storage_majority_down", "storage_majority_paused"):
            chosen = sorted(rng.sample(self._pool(roles.storage), majority))
            return Fault(at, kind, hold, tuple(chosen))
        if kind == "servers_down":
            return Fault(at, kind, hold, roles.servers)
        if kind == "long_coordination_outage":
            return Fault(
                at, kind, round(self.session_timeout * 1.5 + hold, 3), (roles.coordination,)
            )
        if kind == "storage_cut_off":
            cut = sorted(rng.sample(roles.storage, majority))
            links = tuple(link for s in roles.servers for n in cut for link in ((s, n), (n, s)))
            return Fault(at, kind, hold, links=links)
        raise ChaosError(f"unknown fault {kind!r}")

    def _draw_storage(self, kind: str, at: float, limit: float) -> Fault | None:
        rng = self.rng
        hold = rng.uniform(2.0, 6.0) if kind == "flip_sealed" else rng.uniform(1.0, 4.0)
        pool = self._pool(self.roles.storage)
        if kind == "rollback_data":  # to a copy taken at an earlier stop of the node
            pool = [n for n in pool if self._stopped_before(n, at)]
        if not pool:
            return None
        target = rng.choice(pool)
        duration = round(hold + REPAIR_ALLOWANCE, 3)
        if at + duration > limit:
            return None
        return Fault(at, kind, duration, (target,), hold=round(hold, 3))

    def _stopped_before(self, node: str, at: float) -> bool:
        return any(
            f.kind in STOPPING_FAULTS and node in f.targets and f.end <= at for f in self.placed
        )

    def _pair(self) -> tuple[str, str]:
        rng, roles = self.rng, self.roles
        categories = [
            ("server", "storage"),
            ("server", "coordination"),
            ("client", "server"),
            ("client", "coordination"),
        ]
        if len(roles.servers) > 1:
            categories.append(("server", "server"))
        first, second = rng.choice(categories)
        pool = {
            "server": roles.servers,
            "storage": roles.storage,
            "client": roles.clients,
            "coordination": (roles.coordination,),
        }
        a = rng.choice(pool[first])
        b = rng.choice([r for r in pool[second] if r != a])
        return a, b

    # -- the rules ------------------------------------------------------------------------

    def impaired(self, fault: Fault) -> tuple[set[str], set[str]]:
        """(storage nodes, servers) that ``fault`` impairs."""
        return impaired_by(fault, self.roles)

    def links_of(self, fault: Fault) -> set[tuple[str, str]]:
        links = set(fault.links)
        if fault.kind == "isolate":
            target = fault.targets[0]
            for a, b in self.roles.links():
                if target in (a, b):
                    links |= {(a, b), (b, a)}
        if fault.kind == "session_expiry" and self.network:
            target, coordination = fault.targets[0], self.roles.coordination
            links |= {(target, coordination), (coordination, target)}
        return links

    def fits(self, candidate: Fault) -> bool:
        overlapping = [f for f in self.placed if f.end > candidate.at and f.at < candidate.end]
        if candidate.quorum:
            return not overlapping
        if any(f.quorum for f in overlapping):
            return False
        busy = {t for f in overlapping if f.kind in PROCESS_FAULTS for t in f.targets}
        if candidate.kind in PROCESS_FAULTS and busy & set(candidate.targets):
            return False
        taken = set().union(*(self.links_of(f) for f in overlapping)) if overlapping else set()
        if taken & self.links_of(candidate):
            return False
        coordination_faults = ("coordination_restart", "session_expiry")
        if candidate.kind in coordination_faults and any(
            f.kind == "coordination_restart"
            or (candidate.kind == "coordination_restart" and f.kind in coordination_faults)
            for f in overlapping
        ):
            return False
        storage: set[str] = set()
        servers: set[str] = set()
        for fault in (*overlapping, candidate):
            s_hit, v_hit = self.impaired(fault)
            storage |= s_hit
            servers |= v_hit
        minority = (len(self.roles.storage) - 1) // 2
        return len(storage) <= minority and len(servers) < len(self.roles.servers)


def impaired_by(fault: Fault, roles: Roles) -> tuple[set[str], set[str]]:
    """(storage nodes, servers) that ``fault`` impairs: killed, paused, its disk full or
    damaged, isolated, its session expiring, or cut off from a server (storage nodes) or
    from coordination (servers)."""
    storage, servers = set(roles.storage), set(roles.servers)
    coordination = roles.coordination
    s_hit: set[str] = set()
    v_hit: set[str] = set()
    if (
        fault.kind in ("kill", "pause", "disk_full", "isolate", "session_expiry", *STORAGE_FAULTS)
        or fault.quorum
    ):
        s_hit |= set(fault.targets) & storage
        v_hit |= set(fault.targets) & servers
    for a, b in fault.links:
        for x, y in ((a, b), (b, a)):
            if x in storage and y in servers:
                s_hit.add(x)
            if x in servers and y == coordination:
                v_hit.add(x)
    if fault.kind == "storage_cut_off":
        v_hit = set()
    return s_hit, v_hit


def generate(
    seed: int,
    roles: Roles,
    *,
    duration: float,
    quiet: float,
    profile_spec: str = "standard",
    network: bool = True,
    disk: bool = True,
    session_timeout: float = 4.0,
    coordination: bool = True,
    eligible: Collection[str] | None = None,
    data: bool = True,
) -> Schedule:
    """The schedule of ``seed`` (see the module docstring). Without ``network``, ``disk``,
    ``coordination`` (a service the run does not own) or ``data`` (the storage nodes'
    data directories: an attached cluster's are not the run's) the faults that need them
    are left out; ``eligible``: the only processes faults may act on (default: all)."""
    chosen = profile_of(profile_spec)
    rng = random.Random(f"waltz-chaos:{seed}:schedule")
    gen = _Generator(
        rng,
        roles,
        network=network,
        disk=disk,
        session_timeout=session_timeout,
        coordination=coordination,
        eligible=eligible,
        data=data,
    )
    weights = {k: w for k, w in sorted(chosen.weights.items()) if gen.available(k) and w > 0}
    quorum_kinds = [k for k in chosen.quorum if gen.available(k)]
    end = duration - quiet
    quorum: list[Fault] = []
    if quorum_kinds and end - WARM_UP > 20.0:
        slot_end = end - 1.0  # the last quorum fault heals just before the quiet phase
        while slot_end > WARM_UP + QUORUM_EVERY / 2 or not quorum:
            drawn = gen.draw(rng.choice(quorum_kinds), 0.0, float("inf"))
            assert drawn is not None
            quorum.append(replace(drawn, at=round(slot_end - drawn.duration, 3)))
            slot_end -= QUORUM_EVERY
    gen.placed.extend(quorum)
    kinds = list(weights)
    t = WARM_UP
    while kinds:
        t += rng.uniform(*chosen.gap)
        if t >= end - 1.0:
            break
        if any(q.at <= t < q.end + QUORUM_RECOVERY for q in quorum):
            continue  # a quorum fault and the recovery after it: no other fault
        # a regular fault heals before the next quorum fault (with a margin: an injection
        # can be late by the time a kill or a fill takes)
        limit = min([end, *(q.at - 2.0 for q in quorum if q.at > t)])
        for _attempt in range(6):
            kind = rng.choices(kinds, [weights[k] for k in kinds])[0]
            fault = gen.draw(kind, t, limit)
            if fault is not None and fault.end <= limit and gen.fits(fault):
                gen.placed.append(fault)
                break
    faults = sorted(gen.placed, key=lambda f: (f.at, f.kind))
    return Schedule(seed, duration, quiet, chosen.name, roles, faults)


__all__ = [
    "FAULT_DESCRIPTIONS",
    "LINK_FAULTS",
    "NETWORK_FAULTS",
    "PROCESS_FAULTS",
    "PROFILES",
    "QUORUM_FAULTS",
    "REPAIR_ALLOWANCE",
    "STOPPED_STORAGE_FAULTS",
    "STOPPING_FAULTS",
    "STORAGE_FAULTS",
    "WARM_UP",
    "Fault",
    "Profile",
    "Roles",
    "Schedule",
    "generate",
    "impaired_by",
    "profile_of",
]
