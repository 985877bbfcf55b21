"""Network namespaces for a chaos run: each role in its own namespace, one veth pair
per pair of roles that talk, and the faults on those links.

The topology: every role (the coordination service, each storage node, server and
client, and ``admin``: the chaos process itself) gets a namespace of its own named
``waltz-chaos-<run>-<role>`` and one address of a private range (``10.77.0.0/24``)
that exists only inside the run's namespaces. Two roles that talk get a veth pair of
their own (``to-<peer>`` at each end, carrying the end's own address, with a route
to the peer's address through it). Nothing is added to the machine's own namespace:
the run's traffic never leaves its namespaces.

A pair of its own per link makes a fault between two roles a property of one
interface. A fault acts on the sending end (its egress queue), so each direction is
faulted alone (an asymmetric cut is one direction):

- *cut*: a ``pfifo`` queue of length 0: every packet is dropped, silently (the
  sender's TCP retransmits into the void, as across a real partition);
- *slow*: ``netem delay`` when the kernel has netem; else a ``tbf`` rate limit
  (small packets pass nearly on time, bulk traffic queues up to seconds);
- *lossy*: ``netem loss`` when the kernel has netem; else an ``htb`` queue whose
  classic BPF filter draws a random number per packet (``cls_bpf``) and sends the
  chosen share of the packets to a class that drops them.

Healing deletes the queue. :meth:`NetworkLab.destroy` deletes every namespace the
run created, by name (their interfaces go with them).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from waltz_chaos.errors import ChaosError

log = logging.getLogger(__name__)

NETWORK_PREFIX = "10.77.0"
"""The private range of a run's addresses (inside its namespaces only)."""
NAMESPACE_PREFIX = "waltz-chaos-"
_CLONE_NEWNET = 0x40000000
_NETNS_DIR = "/run/netns"


@dataclass(frozen=True)
class LinkShape:
    """What a fault does to one direction of a link."""

    kind: str
    """``cut``, ``slow`` or ``lossy``."""
    delay_ms: int = 0
    """``slow`` with netem: the added delay (jitter a quarter of it)."""
    rate_kbit: int = 0
    """``slow`` without netem: the rate limit."""
    loss: float = 0.0
    """``lossy``: the share of packets dropped (0..1)."""

    def describe(self, netem: bool) -> str:
        if self.kind == "cut":
            return "cut"
        if self.kind == "slow":
            return f"+{self.delay_ms} ms" if netem else f"limited to {self.rate_kbit} kbit/s"
        return f"{self.loss:.0%} loss"


@dataclass(frozen=True)
class Host:
    """A role's place in the network: its namespace and address."""

    role: str
    short: str
    namespace: str
    address: str


def short_name(role: str) -> str:
    """``storage-0`` -> ``s0``, ``server-1`` -> ``v1``, ``client-2`` -> ``c2``."""
    kind, _, index = role.rpartition("-")
    letters = {"storage": "s", "server": "v", "client": "c"}
    if kind in letters and index.isdigit():
        return f"{letters[kind]}{index}"
    return role[:8]


def address_of(role: str) -> str:
    """The fixed address of ``role`` in the run's range."""
    fixed = {"admin": 1, "coordination": 2}
    if role in fixed:
        return f"{NETWORK_PREFIX}.{fixed[role]}"
    kind, _, index = role.rpartition("-")
    base = {"storage": 10, "server": 40, "client": 70}
    if kind not in base or not index.isdigit() or int(index) >= 30:
        raise ChaosError(f"no address for role {role!r}")
    return f"{NETWORK_PREFIX}.{base[kind] + int(index)}"


def namespaces_available() -> str | None:
    """Why the run cannot use network namespaces (None: it can)."""
    if os.geteuid() != 0:
        return "not running as root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command (iproute2) is not installed"
    return None


def _run(args: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
    result = subprocess.run(
        list(args), input=stdin, capture_output=True, text=True, check=False, timeout=60
    )
    if check and result.returncode != 0:
        what = " ".join(args) if stdin is None else f"{' '.join(args)} <<{stdin.strip()!r}"
        raise ChaosError(f"{what} failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout


class NetworkLab:
    """The namespaces and links of one run (see the module docstring)."""

    def __init__(self, run_id: str, roles: Sequence[str], links: Iterable[tuple[str, str]]):
        self.run_id = run_id
        self.hosts = {
            role: Host(
                role, short_name(role), f"{NAMESPACE_PREFIX}{run_id}-{role}", address_of(role)
            )
            for role in roles
        }
        self.links: list[tuple[str, str]] = sorted({(min(a, b), max(a, b)) for a, b in links})
        self.netem = False
        self._peers: dict[str, set[str]] = {role: set() for role in roles}
        for a, b in self.links:
            self._peers[a].add(b)
            self._peers[b].add(a)
        self._created: list[str] = []
        self._home_fd: int | None = None
        self._shapes: dict[tuple[str, str], LinkShape] = {}

    # -- set-up and tear-down ---------------------------------------------------------

    def create(self) -> None:
        """Create every namespace and link; on failure, remove what was created."""
        try:
            for host in self.hosts.values():
                _run(["ip", "netns", "add", host.namespace])
                self._created.append(host.namespace)
            veths = []
            for a, b in self.links:
                ha, hb = self.hosts[a], self.hosts[b]
                veths.append(
                    f"link add {self.device(a, b)} netns {ha.namespace} type veth "
                    f"peer name {self.device(b, a)} netns {hb.namespace}"
                )
            _run(["ip", "-batch", "-"], stdin="\n".join(veths) + "\n")
            for role, host in self.hosts.items():
                commands = ["link set lo up"]
                for peer in sorted(self._peers[role]):
                    device = self.device(role, peer)
                    commands += [
                        f"addr add {host.address}/32 dev {device}",
                        f"link set {device} up",
                        f"route add {self.hosts[peer].address}/32 dev {device} src {host.address}",
                    ]
                _run(["ip", "-n", host.namespace, "-batch", "-"], stdin="\n".join(commands) + "\n")
            self.netem = self._probe_netem()
        except BaseException:
            self.destroy()
            raise
        log.info(
            "network: %d namespaces, %d links%s",
            len(self.hosts),
            len(self.links),
            "" if self.netem else " (no netem in this kernel: slow links are rate limits)",
        )

    def _probe_netem(self) -> bool:
        namespace = self.hosts["admin"].namespace if "admin" in self.hosts else None
        if namespace is None:
            return False
        added = subprocess.run(
            ["tc", "-n", namespace, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
            capture_output=True,
            check=False,
        )
        if added.returncode != 0:
            return False
        _run(["tc", "-n", namespace, "qdisc", "del", "dev", "lo", "root"], check=False)
        return True

    def destroy(self) -> None:
        """Delete every namespace this lab created (by name); safe to call twice."""
        self.leave()
        while self._created:
            namespace = self._created.pop()
            result = subprocess.run(
                ["ip", "netns", "delete", namespace], capture_output=True, text=True, check=False
            )
            if result.returncode != 0 and os.path.exists(os.path.join(_NETNS_DIR, namespace)):
                log.warning("could not delete namespace %s: %s", namespace, result.stderr.strip())

    @property
    def namespaces(self) -> list[str]:
        return list(self._created)

    # -- where things run ---------------------------------------------------------------

    def device(self, role: str, peer: str) -> str:
        """The interface in ``role``'s namespace that leads to ``peer``."""
        return f"to-{self.hosts[peer].short}"

    def wrap(self, role: str) -> list[str]:
        """The command prefix that runs a process in ``role``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[role].namespace]

    def address(self, role: str) -> str:
        return self.hosts[role].address

    def peers(self, role: str) -> list[str]:
        return sorted(self._peers[role])

    def enter(self, role: str) -> None:
        """Move this thread (the chaos process's main thread, before it starts any
        other) into ``role``'s namespace: its own connections then go through the
        run's links. :meth:`leave` goes back."""
        if threading.active_count() > 1:
            log.warning(
                "entering %s with %d threads running: those stay outside it",
                self.hosts[role].namespace,
                threading.active_count() - 1,
            )
        if self._home_fd is None:
            self._home_fd = os.open("/proc/self/ns/net", os.O_RDONLY)
        fd = os.open(os.path.join(_NETNS_DIR, self.hosts[role].namespace), os.O_RDONLY)
        try:
            _setns(fd)
        finally:
            os.close(fd)

    def leave(self) -> None:
        if self._home_fd is not None:
            try:
                _setns(self._home_fd)
            finally:
                os.close(self._home_fd)
                self._home_fd = None

    # -- faults -------------------------------------------------------------------------

    def shape(self, source: str, target: str, shape: LinkShape | None) -> None:
        """Apply ``shape`` to the packets ``source`` sends to ``target`` (None: heal)."""
        if target not in self._peers.get(source, ()):
            raise ChaosError(f"no link between {source} and {target}")
        namespace = self.hosts[source].namespace
        device = self.device(source, target)
        if shape is None:
            if self._shapes.pop((source, target), None) is not None:
                _run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], check=False)
            return
        if (source, target) in self._shapes:
            _run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], check=False)
        _run(["tc", "-n", namespace, "-batch", "-"], stdin=self._qdisc(device, shape))
        self._shapes[(source, target)] = shape

    def _qdisc(self, device: str, shape: LinkShape) -> str:
        root = f"qdisc add dev {device} root"
        if shape.kind == "cut":
            return f"{root} pfifo limit 0\n"
        if shape.kind == "slow":
            if self.netem:
                jitter = max(1, shape.delay_ms // 4)
                return f"{root} netem delay {shape.delay_ms}ms {jitter}ms\n"
            return f"{root} tbf rate {shape.rate_kbit}kbit burst 4kb latency 10s\n"
        if shape.kind == "lossy":
            if self.netem:
                return f"{root} netem loss {shape.loss * 100:.1f}%\n"
            threshold = int(shape.loss * 0xFFFFFFFF)
            # cBPF: A = a random u32 (SKF_AD_RANDOM); A >= threshold ? no match : class 1:20
            program = f"4,32 0 0 {0xFFFFF000 + 56},53 1 0 {threshold},6 0 0 {0x10020},6 0 0 0,"
            return "".join(
                [
                    f"{root} handle 1: htb default 10 r2q 10000\n",
                    f"class add dev {device} parent 1: classid 1:10 htb rate 10gbit\n",
                    f"class add dev {device} parent 1: classid 1:20 htb rate 10gbit\n",
                    f"qdisc add dev {device} parent 1:20 handle 20: pfifo limit 0\n",
                    f'filter add dev {device} parent 1: prio 1 bpf bytecode "{program}" '
                    "classid 1:20\n",
                ]
            )
        raise ChaosError(f"unknown link shape {shape.kind!r}")

    def heal_all(self) -> None:
        for source, target in list(self._shapes):
            with contextlib.suppress(ChaosError):
                self.shape(source, target, None)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc().setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise ChaosError(f"setns failed: {os.strerror(errno)}")


def leftover_namespaces() -> list[str]:
    """Namespaces of chaos runs that ended without removing them (a run killed -9)."""
    with contextlib.suppress(FileNotFoundError):
        return sorted(n for n in os.listdir(_NETNS_DIR) if n.startswith(NAMESPACE_PREFIX))
    return []


__all__ = [
    "NAMESPACE_PREFIX",
    "NETWORK_PREFIX",
    "Host",
    "LinkShape",
    "NetworkLab",
    "address_of",
    "leftover_namespaces",
    "namespaces_available",
    "short_name",
]
