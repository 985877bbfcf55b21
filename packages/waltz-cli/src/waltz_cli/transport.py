"""``--transport`` and ``--transport-option KEY=VALUE``: how a command reaches servers
and storage nodes (the same two options on every command that connects)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

from waltz_api.errors import ConfigError

TRANSPORT_OPTION_HELP = (
    "A transport option (JSON value or text), repeatable; e.g. a client's Curve keys "
    "(zmq): curve_client_key=PATH.key_secret curve_server_public_key=PATH.key"
)


def parse_transport_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs -> options (a value that parses as JSON is that JSON)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(
                f"--transport-option takes KEY=VALUE, got {pair!r}", key="transport_option"
            )
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def transport_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Adds ``--transport`` (passed as ``transport``) and ``--transport-option`` (passed as
    ``transport_options``, the raw pairs: parse them with :func:`parse_transport_options`)."""
    func = click.option(
        "--transport-option",
        "transport_options",
        multiple=True,
        metavar="KEY=VALUE",
        help=TRANSPORT_OPTION_HELP,
    )(func)
    return click.option("--transport", default="zmq", show_default=True, help="Transport plugin.")(
        func
    )
