"""Free loopback ports."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from waltz_api.ports import LOOPBACK, ephemeral_start, free_port, free_ports


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(5)
    assert len(set(ports)) == 5
    for port in [*ports, free_port()]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_ports_are_below_the_ephemeral_range_so_no_outgoing_connection_takes_one() -> None:
    start = ephemeral_start()
    ports = free_ports(50)
    assert all(10_000 <= port < start for port in ports), (start, ports)


def test_a_bound_port_is_never_given() -> None:
    held: list[socket.socket] = []
    try:
        for port in free_ports(20):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind((LOOPBACK, port))
            sock.listen()
        taken = {s.getsockname()[1] for s in held}
        again = set(free_ports(200))
        assert not taken & again
    finally:
        for sock in held:
            sock.close()


def test_a_forked_child_walks_other_ports_than_its_parent() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next ports and leave at once
        os.write(write, ",".join(map(str, free_ports(5))).encode())
        os._exit(0)
    os.close(write)
    child = {int(p) for p in os.read(read, 1000).decode().split(",")}
    os.close(read)
    os.waitpid(pid, 0)
    parent = set(free_ports(5))
    assert len(child) == 5 and not child & parent


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path: Path) -> None:
    path = tmp_path / "range"
    path.write_text("40000\t60999\n")
    assert ephemeral_start(path) == 40000
    path.write_text("garbage")
    assert ephemeral_start(path) == 32768
    assert ephemeral_start(tmp_path / "missing") == 32768
