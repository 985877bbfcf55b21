"""The options of the ZeroMQ transport, validated once at construction.

Every option, its default and its meaning is listed in the package README.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq.auth

from waltz_api.contracts.transport import DEFAULT_MAX_FRAME_SIZE
from waltz_api.errors import ConfigError

SECURITY_MODES = ("auto", "plaintext", "curve")

_DEFAULTS: dict[str, Any] = {
    "max_frame_size": DEFAULT_MAX_FRAME_SIZE,
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 2.5,
    "window_frames": 4096,
    "window_bytes": 4 * 1024 * 1024,
    "coalesce": True,
    "high_water_mark": 0,
    "reconnect_interval": 0.1,
    "reconnect_interval_max": 1.0,
    "linger": 0.1,
    "io_threads": 1,
    "security": "auto",
    "curve_server_key": None,
    "curve_server_public_key": None,
    "curve_client_key": None,
    "curve_authorized_keys": None,
}

Z85_KEY_LENGTH = 40
MAX_FRAME_SIZE = 2**32 - 1
"""The Waltz wire's frame lengths are 32-bit."""
MAX_WINDOW_FRAMES = 2**24
"""So that the automatic high-water mark (2 * window_frames + 4096) fits ZeroMQ's int."""
MAX_WINDOW_BYTES = 2**40


@dataclass(frozen=True)
class CurveKeys:
    public: bytes
    secret: bytes


@dataclass(frozen=True)
class ZmqOptions:
    max_frame_size: int
    heartbeat_interval: float
    heartbeat_timeout: float
    window_frames: int
    window_bytes: int
    coalesce: bool
    high_water_mark: int
    reconnect_interval: float
    reconnect_interval_max: float
    linger: float
    io_threads: int
    security: str
    curve_server_key: CurveKeys | None
    curve_server_public_key: bytes | None
    curve_client_key: CurveKeys | None
    curve_authorized_keys: frozenset[bytes] | None

    @property
    def failure_detection_bound(self) -> float:
        # the watchdog runs every heartbeat_interval, so a silence is noticed at most one
        # interval after it passed heartbeat_timeout
        return self.heartbeat_timeout + self.heartbeat_interval

    @property
    def hwm(self) -> int:
        # credit-based flow control keeps at most window_frames data messages in flight per
        # connection. A ZeroMQ writer learns of reads only every HWM/2 messages, so the HWM is
        # twice the window plus room for control messages: the flow control, not the HWM,
        # is what normally holds a sender back
        return self.high_water_mark or 2 * self.window_frames + 4096

    @property
    def curve_listen(self) -> bool:
        return self.curve_server_key is not None

    @property
    def curve_connect(self) -> bool:
        return self.curve_server_public_key is not None

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> ZmqOptions:
        given = dict(options or {})
        unknown = sorted(set(given) - set(_DEFAULTS))
        if unknown:
            raise ConfigError(
                f"unknown zmq transport option(s) {', '.join(unknown)}; valid options: "
                f"{', '.join(sorted(_DEFAULTS))}",
                key=unknown[0],
            )
        values = {**_DEFAULTS, **given}
        security = values["security"]
        if security not in SECURITY_MODES:
            raise ConfigError(
                f"zmq transport option security must be one of {', '.join(SECURITY_MODES)}, "
                f"got {security!r}",
                key="security",
            )
        opts = cls(
            max_frame_size=_int(values, "max_frame_size", 1, MAX_FRAME_SIZE),
            heartbeat_interval=_float(values, "heartbeat_interval", 0.01),
            heartbeat_timeout=_float(values, "heartbeat_timeout", 0.05),
            window_frames=_int(values, "window_frames", 1, MAX_WINDOW_FRAMES),
            window_bytes=_int(values, "window_bytes", 1, MAX_WINDOW_BYTES),
            coalesce=_bool(values, "coalesce"),
            high_water_mark=_int(values, "high_water_mark", 0, 2**31 - 1),
            reconnect_interval=_float(values, "reconnect_interval", 0.001),
            reconnect_interval_max=_float(values, "reconnect_interval_max", 0.001),
            linger=_float(values, "linger", 0.0),
            io_threads=_int(values, "io_threads", 1),
            security=security,
            curve_server_key=_keypair(values, "curve_server_key"),
            curve_server_public_key=_public_key(values, "curve_server_public_key"),
            curve_client_key=_keypair(values, "curve_client_key"),
            curve_authorized_keys=_authorized(values, "curve_authorized_keys"),
        )
        if opts.heartbeat_timeout <= opts.heartbeat_interval:
            raise ConfigError(
                "heartbeat_timeout must be larger than heartbeat_interval (a few intervals: "
                f"got timeout {opts.heartbeat_timeout} s, interval {opts.heartbeat_interval} s)",
                key="heartbeat_timeout",
            )
        if opts.high_water_mark and opts.high_water_mark <= 2 * opts.window_frames:
            raise ConfigError(
                "high_water_mark must exceed 2 * window_frames (or be 0 for automatic), else "
                "ZeroMQ would hold back sends the flow control allowed",
                key="high_water_mark",
            )
        any_curve = any(
            values[k] is not None
            for k in (
                "curve_server_key",
                "curve_server_public_key",
                "curve_client_key",
                "curve_authorized_keys",
            )
        )
        if security == "plaintext" and any_curve:
            raise ConfigError(
                "security = 'plaintext' but curve_* keys are configured; remove the keys or "
                "set security = 'curve'",
                key="security",
            )
        if security == "auto" and any_curve:
            object.__setattr__(opts, "security", "curve")
        if opts.security == "curve":
            if (opts.curve_server_key is None) != (opts.curve_authorized_keys is None):
                missing = "curve_authorized_keys" if opts.curve_server_key else "curve_server_key"
                raise ConfigError(
                    f"curve listening needs both curve_server_key and curve_authorized_keys; "
                    f"{missing} is missing",
                    key=missing,
                )
            if (opts.curve_server_public_key is None) != (opts.curve_client_key is None):
                missing = (
                    "curve_client_key"
                    if opts.curve_server_public_key
                    else "curve_server_public_key"
                )
                raise ConfigError(
                    f"curve connecting needs both curve_server_public_key and curve_client_key; "
                    f"{missing} is missing",
                    key=missing,
                )
            if not (opts.curve_listen or opts.curve_connect):
                raise ConfigError(
                    "security = 'curve' needs keys: curve_server_key and curve_authorized_keys "
                    "to listen, curve_server_public_key and curve_client_key to connect "
                    "(make them with `waltz keys generate`)",
                    key="curve_server_key",
                )
        return opts


def is_local_endpoint(endpoint: str) -> bool:
    """True for ipc:// and for tcp:// on a loopback address (plaintext is harmless there)."""
    if endpoint.startswith("ipc://"):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _from_text(value: Any) -> Any:
    """Options may come from text (environment overrides, KEY=VALUE flags): "2.5", "true"."""
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    if text in ("true", "yes", "on"):
        return True
    if text in ("false", "no", "off"):
        return False
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return value


def _int(values: Mapping[str, Any], key: str, minimum: int, maximum: int = 2**63 - 1) -> int:
    value = _from_text(values[key])
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ConfigError(
            f"zmq transport option {key} must be an integer in {minimum}..{maximum}, "
            f"got {value!r:.40}",
            key=key,
        )
    return value


def _float(values: Mapping[str, Any], key: str, minimum: float) -> float:
    value = _from_text(values[key])
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise ConfigError(
            f"zmq transport option {key} must be a number of seconds >= {minimum}, got {value!r}",
            key=key,
        )
    return float(value)


def _bool(values: Mapping[str, Any], key: str) -> bool:
    value = _from_text(values[key])
    if not isinstance(value, bool):
        raise ConfigError(
            f"zmq transport option {key} must be true or false, got {value!r}", key=key
        )
    return value


def _is_z85_key(value: str) -> bool:
    return len(value) == Z85_KEY_LENGTH and not os.path.exists(value)


def _keypair(values: Mapping[str, Any], key: str) -> CurveKeys | None:
    value = values[key]
    if value is None:
        return None
    path = Path(value)
    if not isinstance(value, str | os.PathLike) or not path.is_file():
        raise ConfigError(
            f"zmq transport option {key} must be the path of a secret key file "
            f"(NAME.key_secret, made by `waltz keys generate`); {value!r} is not a file",
            key=key,
        )
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the curve key file {path} ({key}): {exc}", key=key) from exc
    if secret is None:
        raise ConfigError(
            f"{path} ({key}) holds no secret key: give the NAME.key_secret file, not NAME.key",
            key=key,
        )
    return CurveKeys(public=public, secret=secret)


def _public_key(values: Mapping[str, Any], key: str) -> bytes | None:
    value = values[key]
    if value is None:
        return None
    return _load_public(value, key)


def _load_public(value: Any, key: str) -> bytes:
    if isinstance(value, bytes) and len(value) == Z85_KEY_LENGTH:
        return value
    if isinstance(value, str) and _is_z85_key(value):
        return value.encode("ascii")
    if isinstance(value, str | os.PathLike) and Path(value).is_file():
        try:
            public, _secret = zmq.auth.load_certificate(Path(value))
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"cannot read the curve key file {value} ({key}): {exc}", key=key
            ) from exc
        return public
    raise ConfigError(
        f"zmq transport option {key}: {value!r} is neither a Z85 public key (40 characters) "
        "nor a key file (NAME.key)",
        key=key,
    )


def _authorized(values: Mapping[str, Any], key: str) -> frozenset[bytes] | None:
    value = values[key]
    if value is None:
        return None
    keys: set[bytes] = set()
    if isinstance(value, str | os.PathLike) and Path(value).is_dir():
        for entry in sorted(Path(value).glob("*.key")):
            keys.add(_load_public(str(entry), key))
        if not keys:
            raise ConfigError(
                f"zmq transport option {key}: the directory {value} holds no *.key public key "
                "file; copy each allowed client's NAME.key there",
                key=key,
            )
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        for item in value:
            keys.add(_load_public(item, key))
    else:
        keys.add(_load_public(value, key))
    return frozenset(keys)
