"""CurveZMQ: encryption and client authentication, both ways, on real sockets."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from waltz_api.contracts.transport import Connection
from waltz_api.errors import AuthenticationError, ConfigError, ConnectionClosedError
from waltz_transport_zmq import ZmqTransport
from waltz_transport_zmq.keys import KeyPairFiles, generate_keypair

CONNECT_TIMEOUT = 3.0


async def echo(conn: Connection) -> None:
    try:
        while True:
            await conn.send(await conn.recv())
    except ConnectionClosedError:
        return


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, KeyPairFiles]:
    made = {
        name: generate_keypair(tmp_path / "keys", name) for name in ("server", "client", "intruder")
    }
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    shutil.copy(made["client"].public_file, authorized)
    return made


@pytest.fixture
async def curve_server(
    keys: dict[str, KeyPairFiles], tmp_path: Path
) -> AsyncIterator[tuple[ZmqTransport, str]]:
    server = ZmqTransport(
        {
            "curve_server_key": str(keys["server"].secret_file),
            "curve_authorized_keys": str(tmp_path / "authorized"),
        }
    )
    listener = await server.listen("tcp://127.0.0.1:*", echo)
    try:
        yield server, listener.endpoint
    finally:
        await server.close()


def client_options(
    keys: dict[str, KeyPairFiles], who: str, server: str = "server"
) -> dict[str, str]:
    return {
        "curve_server_public_key": str(keys[server].public_file),
        "curve_client_key": str(keys[who].secret_file),
    }


async def test_authorized_client_connects_and_talks(
    keys: dict[str, KeyPairFiles], curve_server: tuple[ZmqTransport, str]
) -> None:
    _, endpoint = curve_server
    client = ZmqTransport(client_options(keys, "client"))
    try:
        conn = await client.connect(endpoint, timeout=CONNECT_TIMEOUT)
        for payload in (b"secret", b"x" * 100_000, b""):
            await conn.send(payload)
            assert await asyncio.wait_for(conn.recv(), 10) == payload
    finally:
        await client.close()


async def test_unknown_client_key_cannot_connect(
    keys: dict[str, KeyPairFiles], curve_server: tuple[ZmqTransport, str]
) -> None:
    _, endpoint = curve_server
    intruder = ZmqTransport(client_options(keys, "intruder"))
    try:
        start = time.monotonic()
        with pytest.raises(AuthenticationError, match="security handshake"):
            await intruder.connect(endpoint, timeout=CONNECT_TIMEOUT)
        assert time.monotonic() - start < CONNECT_TIMEOUT + 2
    finally:
        await intruder.close()
    # the refusal harmed nothing: the authorized client still gets in
    client = ZmqTransport(client_options(keys, "client"))
    try:
        conn = await client.connect(endpoint, timeout=CONNECT_TIMEOUT)
        await conn.send(b"still open")
        assert await asyncio.wait_for(conn.recv(), 10) == b"still open"
    finally:
        await client.close()


SLOW_TIMEOUT = 30.0
"""A connect timeout the refusals must not wait out: they come from the handshake."""


def refusals(caplog: pytest.LogCaptureFixture, says: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if says in r.getMessage()]


async def wait_logged(caplog: pytest.LogCaptureFixture, says: str) -> list[str]:
    async with asyncio.timeout(30):
        while not refusals(caplog, says):  # noqa: ASYNC110 - polls the captured log
            await asyncio.sleep(0.05)
    return refusals(caplog, says)


async def test_client_with_wrong_server_key_is_refused_fast_and_logged(
    keys: dict[str, KeyPairFiles],
    curve_server: tuple[ZmqTransport, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="waltz_transport_zmq")
    _, endpoint = curve_server
    # the client trusts another server key: a man in the middle would look like this
    confused = ZmqTransport(client_options(keys, "client", server="intruder"))
    try:
        for _ in range(3):
            start = time.monotonic()
            with pytest.raises(AuthenticationError, match="trusts another server public key"):
                await confused.connect(endpoint, timeout=SLOW_TIMEOUT)
            assert time.monotonic() - start < SLOW_TIMEOUT / 2
    finally:
        await confused.close()
    logged = await wait_logged(caplog, "handshake failed (it trusts another server public key")
    assert len(logged) == 1 and logged[0].startswith(endpoint)  # once, however many tries


async def test_plaintext_client_against_a_curve_listener_is_refused_fast_and_logged(
    curve_server: tuple[ZmqTransport, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="waltz_transport_zmq")
    _, endpoint = curve_server
    plain = ZmqTransport({})
    try:
        for _ in range(3):
            start = time.monotonic()
            with pytest.raises(AuthenticationError, match="the listener requires CurveZMQ"):
                await plain.connect(endpoint, timeout=SLOW_TIMEOUT)
            assert time.monotonic() - start < SLOW_TIMEOUT / 2
    finally:
        await plain.close()
    # libzmq reports the refused plaintext peer as a mechanism mismatch or, when the peer
    # hung up first, without detail: one line of each kind at most, both saying why
    logged = await wait_logged(caplog, "this listener requires CurveZMQ")
    assert all(line.startswith(f"{endpoint}: refused a") for line in logged), logged
    kinds = [r for r in refusals(caplog, f"{endpoint}: ") if "refused a plaintext peer" in r]
    assert len(kinds) <= 1 and len(logged) <= 2, logged


async def test_curve_client_refuses_plaintext_listener(keys: dict[str, KeyPairFiles]) -> None:
    server = ZmqTransport({"security": "plaintext"})
    client = ZmqTransport(client_options(keys, "client"))
    try:
        listener = await server.listen("tcp://127.0.0.1:*", echo)
        start = time.monotonic()
        with pytest.raises(AuthenticationError, match="does not use CurveZMQ"):
            await client.connect(listener.endpoint, timeout=SLOW_TIMEOUT)
        assert time.monotonic() - start < SLOW_TIMEOUT / 2
    finally:
        await client.close()
        await server.close()


async def test_an_unknown_client_key_is_logged_once_with_its_address(
    keys: dict[str, KeyPairFiles],
    curve_server: tuple[ZmqTransport, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="waltz_transport_zmq")
    _, endpoint = curve_server
    intruder = ZmqTransport(client_options(keys, "intruder"))
    try:
        for _ in range(3):
            with pytest.raises(AuthenticationError, match="refused this transport's curve client"):
                await intruder.connect(endpoint, timeout=SLOW_TIMEOUT)
    finally:
        await intruder.close()
    logged = await wait_logged(caplog, "refused a CurveZMQ client at 127.0.0.1")
    assert len(logged) == 1 and keys["intruder"].public_key in logged[0]


async def test_authorized_keys_as_a_list_of_z85_keys(
    keys: dict[str, KeyPairFiles], tmp_path: Path
) -> None:
    server = ZmqTransport(
        {
            "curve_server_key": str(keys["server"].secret_file),
            "curve_authorized_keys": [keys["intruder"].public_key],
        }
    )
    try:
        listener = await server.listen(f"ipc://{tmp_path}/curve.sock", echo)
        allowed = ZmqTransport(client_options(keys, "intruder"))
        refused = ZmqTransport(client_options(keys, "client"))
        try:
            conn = await allowed.connect(listener.endpoint, timeout=CONNECT_TIMEOUT)
            await conn.send(b"ipc+curve")
            assert await asyncio.wait_for(conn.recv(), 10) == b"ipc+curve"
            with pytest.raises(AuthenticationError):
                await refused.connect(listener.endpoint, timeout=CONNECT_TIMEOUT)
        finally:
            await allowed.close()
            await refused.close()
    finally:
        await server.close()


def test_incomplete_curve_configuration_is_refused(keys: dict[str, KeyPairFiles]) -> None:
    with pytest.raises(ConfigError, match="curve_authorized_keys"):
        ZmqTransport({"curve_server_key": str(keys["server"].secret_file)})
    with pytest.raises(ConfigError, match="curve_client_key"):
        ZmqTransport({"curve_server_public_key": str(keys["server"].public_file)})
    with pytest.raises(ConfigError, match="secret"):
        # the public file where the secret one belongs
        ZmqTransport(
            {
                "curve_server_key": str(keys["server"].public_file),
                "curve_authorized_keys": [keys["client"].public_key],
            }
        )
    with pytest.raises(ConfigError, match="needs keys"):
        ZmqTransport({"security": "curve"})
    with pytest.raises(ConfigError, match="plaintext"):
        ZmqTransport(
            {"security": "plaintext", "curve_authorized_keys": [keys["client"].public_key]}
        )


def test_generate_refuses_to_overwrite(tmp_path: Path) -> None:
    first = generate_keypair(tmp_path, "node")
    assert (first.secret_file.stat().st_mode & 0o777) == 0o600
    with pytest.raises(ConfigError, match="already exist"):
        generate_keypair(tmp_path, "node")
    second = generate_keypair(tmp_path, "node", overwrite=True)
    assert second.public_key != first.public_key
    with pytest.raises(ConfigError, match="invalid"):
        generate_keypair(tmp_path, "../escape")
