"""``waltz keys generate``: key files that the zmq transport accepts (and refuses) for real."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from waltz_api.contracts.transport import Connection
from waltz_api.errors import AuthenticationError, ConnectionClosedError
from waltz_cli import main


def _generate(out: Path, name: str) -> str:
    result = CliRunner().invoke(main, ["keys", "generate", "--out", str(out), "--name", name])
    assert result.exit_code == 0, result.output
    assert (out / f"{name}.key").is_file()
    assert (out / f"{name}.key_secret").stat().st_mode & 0o077 == 0
    return result.output


def test_generate_writes_a_key_pair_and_refuses_to_overwrite(tmp_path: Path) -> None:
    output = _generate(tmp_path / "keys", "server")
    assert "public key:" in output
    again = CliRunner().invoke(
        main, ["keys", "generate", "--out", str(tmp_path / "keys"), "--name", "server"]
    )
    assert again.exit_code == 1
    assert "already exist" in again.output
    forced = CliRunner().invoke(
        main, ["keys", "generate", "--out", str(tmp_path / "keys"), "--name", "server", "--force"]
    )
    assert forced.exit_code == 0, forced.output


def test_an_unwritable_directory_is_one_line(tmp_path: Path) -> None:
    """Not a traceback (37 lines before): one error line naming the directory."""
    below_a_file = tmp_path / "a-file" / "keys"
    (tmp_path / "a-file").write_text("not a directory")
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o500)
    # root writes into a read-only directory anyway: /proc/self refuses everyone
    unwritable = Path("/proc/self") if os.geteuid() == 0 else read_only
    for out in (below_a_file, unwritable):
        result = CliRunner().invoke(main, ["keys", "generate", "--out", str(out)])
        assert result.exit_code == 1, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1, result.output
        assert lines[0].startswith(f"error: cannot write the key files into {out}: "), lines
        assert "--out" in lines[0]
        assert not (out / "waltz.key").exists() and not (out / "waltz.key_secret").exists()


async def test_generated_keys_secure_the_zmq_transport(tmp_path: Path) -> None:
    from waltz_transport_zmq import ZmqTransport

    keys = tmp_path / "keys"
    for name in ("server", "client", "stranger"):
        _generate(keys, name)
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    shutil.copy(keys / "client.key", authorized)

    async def echo(conn: Connection) -> None:
        try:
            while True:
                await conn.send(await conn.recv())
        except ConnectionClosedError:
            return

    server = ZmqTransport(
        {
            "curve_server_key": str(keys / "server.key_secret"),
            "curve_authorized_keys": str(authorized),
        }
    )

    def client(name: str) -> ZmqTransport:
        return ZmqTransport(
            {
                "curve_server_public_key": str(keys / "server.key"),
                "curve_client_key": str(keys / f"{name}.key_secret"),
            }
        )

    good, bad = client("client"), client("stranger")
    try:
        listener = await server.listen("tcp://127.0.0.1:*", echo)
        conn = await good.connect(listener.endpoint, timeout=5)
        await conn.send(b"hello")
        assert await asyncio.wait_for(conn.recv(), 10) == b"hello"
        with pytest.raises(AuthenticationError):
            await bad.connect(listener.endpoint, timeout=5)
    finally:
        await good.close()
        await bad.close()
        await server.close()
