"""``waltz keys``: CurveZMQ key pairs for the zmq transport, contributed through the
``waltz_cli_commands`` hook (:mod:`waltz_transport_zmq.plugin`)."""

from __future__ import annotations

from pathlib import Path

import click


@click.group("keys")
def keys_group() -> None:
    """CurveZMQ key pairs (encryption and client authentication of the zmq transport)."""


@keys_group.command("generate")
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for NAME.key (public) and NAME.key_secret (created, mode 0700).",
)
@click.option("--name", default="waltz", show_default=True, help="Base name of the key files.")
@click.option("--force", is_flag=True, help="Replace existing key files of that name.")
def generate(out_dir: Path, name: str, force: bool) -> None:
    """Generate a key pair: give the secret file to its owner only, the public file to peers.

    A server uses its NAME.key_secret as curve_server_key and lists the clients'
    NAME.key files in curve_authorized_keys (a directory of them); a client uses
    its NAME.key_secret as curve_client_key and the server's NAME.key as
    curve_server_public_key.
    """
    from waltz_transport_zmq.keys import generate_keypair

    files = generate_keypair(out_dir, name, overwrite=force)
    click.echo(f"public key file: {files.public_file}")
    click.echo(f"secret key file: {files.secret_file} (keep it private)")
    click.echo(f"public key: {files.public_key}")
