"""Network namespaces and link faults, on real namespaces (root): a TCP service in one
role's namespace, reached from another's, while links are cut, one way or both, slowed
and made lossy; everything removed at the end. Without root these are skipped (the
chaos tox env runs as root and requires them: WALTZ_CHAOS_REQUIRE_NETNS=1)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from waltz_chaos.netns import (
    NAMESPACE_PREFIX,
    LinkShape,
    NetworkLab,
    address_of,
    leftover_namespaces,
    namespaces_available,
    short_name,
)

WHY_NOT = namespaces_available()
if WHY_NOT is not None and os.environ.get("WALTZ_CHAOS_REQUIRE_NETNS") == "1":
    raise RuntimeError(f"WALTZ_CHAOS_REQUIRE_NETNS=1 but {WHY_NOT}")
needs_root = pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces: {WHY_NOT}")

SERVER = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 7000)); s.listen()
    print("listening", flush=True)
    while True:
        c, _ = s.accept()
        while data := c.recv(65536):
            c.sendall(data)
        c.close()
    """
)
CLIENT = textwrap.dedent(
    """
    import socket, sys, time
    size = int(sys.argv[2])
    start = time.monotonic()
    try:
        s = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[3]))
        s.settimeout(30.0)
        s.sendall(b"x" * size)
        got = 0
        while got < size:
            got += len(s.recv(65536))
        print(f"ok {time.monotonic() - start:.3f}")
    except OSError as exc:
        print(f"failed {type(exc).__name__}")
    """
)


def test_names_and_addresses() -> None:
    assert short_name("storage-3") == "s3"
    assert short_name("server-0") == "v0"
    assert short_name("client-12") == "c12"
    assert short_name("coordination") == "coordina"
    assert address_of("admin") == "10.77.0.1"
    assert address_of("coordination") == "10.77.0.2"
    assert address_of("storage-2") == "10.77.0.12"
    assert address_of("server-1") == "10.77.0.41"
    assert address_of("client-3") == "10.77.0.73"


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[NetworkLab]:
    roles = ["admin", "server-0", "storage-0"]
    lab = NetworkLab(
        f"t{os.getpid() % 100000}",
        roles,
        [("server-0", "storage-0"), ("admin", "server-0"), ("admin", "storage-0")],
    )
    lab.create()
    server = subprocess.Popen(
        [*lab.wrap("storage-0"), sys.executable, "-c", SERVER, lab.address("storage-0")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "listening"
        yield lab
    finally:
        server.kill()
        server.wait(timeout=10)
        lab.destroy()


def reach(lab: NetworkLab, size: int = 100, connect_timeout: float = 2.0) -> str:
    """``ok SECONDS`` (size bytes echoed by storage-0 to server-0), or ``failed ERROR``.
    A cut fails the connect within ``connect_timeout``; a lossy link needs a longer one
    (its SYN-ACKs are lost too, and the SYN is sent again after 1, 3, 7 s)."""
    result = subprocess.run(
        [
            *lab.wrap("server-0"),
            sys.executable,
            "-c",
            CLIENT,
            lab.address("storage-0"),
            str(size),
            str(connect_timeout),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return result.stdout.strip()


def dropped(lab: NetworkLab, source: str, target: str) -> int:
    """Packets the queues of the link source -> target dropped."""
    namespace, device = lab.hosts[source].namespace, lab.device(source, target)
    shown = subprocess.run(
        ["tc", "-n", namespace, "-s", "qdisc", "show", "dev", device],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum(int(n) for n in re.findall(r"dropped (\d+)", shown))


@needs_root
def test_links_are_cut_one_way_or_both_and_heal(lab: NetworkLab) -> None:
    assert reach(lab).startswith("ok")
    lab.shape("server-0", "storage-0", LinkShape("cut"))
    assert reach(lab) == "failed TimeoutError"
    lab.shape("server-0", "storage-0", None)
    assert reach(lab).startswith("ok")
    # the answers cut: the connection cannot complete either (its SYN-ACK is lost)
    lab.shape("storage-0", "server-0", LinkShape("cut"))
    assert reach(lab) == "failed TimeoutError"
    lab.heal_all()
    assert reach(lab).startswith("ok")


@needs_root
def test_a_slow_link_and_a_lossy_link(lab: NetworkLab) -> None:
    quick = float(reach(lab, 200_000).split()[1])
    lab.shape("storage-0", "server-0", LinkShape("slow", delay_ms=200, rate_kbit=256))
    slow = float(reach(lab, 200_000).split()[1])
    # netem: +200 ms per round trip; tbf: 200 kB at 256 kbit/s is over 6 s
    assert slow > quick + 0.35, (quick, slow)
    # 30%, not 50%, and a long connect timeout: at 50% with 2 s to connect it failed
    # once (TimeoutError: a SYN-ACK or a segment lost several times running). Its time
    # tells little: on a link of 0.1 ms round trips TCP recovers from a loss in
    # milliseconds (1 MB took 4 ms through 30% loss); the queue's drop count tells.
    lab.shape("storage-0", "server-0", LinkShape("lossy", loss=0.3))
    lossy = reach(lab, 1_000_000, connect_timeout=20.0)
    assert lossy.startswith("ok"), lossy  # TCP retransmits through it
    assert dropped(lab, "storage-0", "server-0") > 0
    lab.heal_all()
    assert float(reach(lab, 200_000).split()[1]) < slow


@needs_root
def test_the_chaos_process_enters_a_namespace_and_leaves_it(lab: NetworkLab) -> None:
    home = os.readlink("/proc/thread-self/ns/net")
    admin = os.stat(f"/run/netns/{lab.hosts['admin'].namespace}").st_ino
    lab.enter("admin")
    try:
        assert os.readlink("/proc/thread-self/ns/net") == f"net:[{admin}]"
        with socket.create_connection((lab.address("storage-0"), 7000), timeout=5.0) as s:
            s.sendall(b"ping")
            assert s.recv(4) == b"ping"
    finally:
        lab.leave()
    assert os.readlink("/proc/thread-self/ns/net") == home


@needs_root
def test_destroy_removes_every_namespace(tmp_path: Path) -> None:
    lab = NetworkLab(f"d{os.getpid() % 100000}", ["admin", "server-0"], [("admin", "server-0")])
    lab.create()
    names = lab.namespaces
    assert set(names) <= set(leftover_namespaces())
    assert all(n.startswith(NAMESPACE_PREFIX) for n in names)
    lab.destroy()
    lab.destroy()  # twice is harmless
    assert not set(names) & set(leftover_namespaces())
