"""CurveZMQ key pairs for the zmq transport (``waltz keys generate``)."""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from waltz_api.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


@dataclass(frozen=True)
class KeyPairFiles:
    public_file: Path
    secret_file: Path
    public_key: str


def generate_keypair(
    out_dir: str | os.PathLike[str], name: str, *, overwrite: bool = False
) -> KeyPairFiles:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (mode 0600) into ``out_dir``.

    Refuses to replace existing files unless ``overwrite``: a replaced server key
    locks every client out, and a replaced client key is refused by every server.
    """
    if not _NAME.match(name):
        raise ConfigError(
            f"key name {name!r} is invalid: use letters, digits, '.', '_' or '-' (no path)",
            key="name",
        )
    if not zmq.has("curve"):
        raise ConfigError("this libzmq was built without CURVE support; install pyzmq's wheel")
    directory = Path(out_dir)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{directory} exists and is not a directory", key="out")
    public_file = directory / f"{name}.key"
    secret_file = directory / f"{name}.key_secret"
    existing = [f for f in (public_file, secret_file) if f.exists()]
    if existing and not overwrite:
        raise ConfigError(
            f"{', '.join(str(f) for f in existing)} already exist(s); choose another --name or "
            "directory (replacing a key locks out everyone who trusts the old one)",
            key="name",
        )
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        public_path, secret_path = zmq.auth.create_certificates(directory, name)
        os.chmod(secret_path, 0o600)
    except OSError as exc:
        for partial in {public_file, secret_file} - set(existing):  # made before it failed
            with contextlib.suppress(OSError):
                partial.unlink()
        raise ConfigError(
            f"cannot write the key files into {directory}: {exc.strerror or exc}; give "
            "--out a directory you can write",
            key="out",
        ) from None
    public_key, _ = zmq.auth.load_certificate(public_path)
    return KeyPairFiles(Path(public_path), Path(secret_path), public_key.decode("ascii"))
