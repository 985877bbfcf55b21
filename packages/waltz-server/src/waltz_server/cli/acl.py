"""``waltz acl``: per-partition permissions of client keys (the cluster's ACL).

The ACL lives in the coordination service (``/acl``, ``waltz_api.access``); every
server watches it and applies a change to the next request. ``grant`` / ``revoke``
change the grants, ``enable`` / ``disable`` turn enforcement on and off (grants can
be prepared and checked first), ``list`` and ``check`` read. A key is a CurveZMQ
public key (Z85, 40 characters), its ``NAME.key`` file (``waltz keys generate``;
the file's NAME becomes the key's name), or the name of a key already in the ACL.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from waltz_api.access import (
    EVERY_PARTITION,
    AccessControl,
    Permission,
    check_identity,
    describe,
    is_curve_key,
    parse_partition,
    partition_label,
    read_key_file,
)
from waltz_api.errors import ConfigError
from waltz_cli.coordination import coordination_option
from waltz_cli.output import emitted, output_option
from waltz_server.cli.cluster import _run_with_metadata as _run
from waltz_server.cluster_admin import ClusterAdmin

DENIED_EXIT_CODE = 3
"""``waltz acl check``'s exit code when the key does not hold the permission."""


@click.group("acl")
def acl_group() -> None:
    """Per-partition permissions (read, write, admin) of client keys, enforced by every
    server once enabled.

    read: mount, feed, data fetch, range read, high-water mark, flush. write: append
    (and read). admin: write and read. Not enforced (no ACL, or after `waltz acl
    disable`): every client may do everything. Enforced: a client is served only what
    its CurveZMQ key is granted; a plaintext client nothing. Changes apply on running
    servers within the coordination watch's delay (about a second).
    """


# -- options ----------------------------------------------------------------------------------

_key_option = click.option(
    "--key",
    "key",
    required=True,
    metavar="KEY",
    help="A client's CurveZMQ public key (Z85), its NAME.key file, or a key's name in the ACL.",
)
_partition_help = "A partition id, or 'all' (every partition); repeatable."
_permission_choice = click.Choice(["read", "write", "admin"])


@dataclass(frozen=True)
class _Key:
    identity: str
    name: str | None
    """From the key file's name (None: keep the ACL's)."""
    note: str | None = None


def _resolve_key(value: str, acl: AccessControl) -> _Key:
    path = Path(value).expanduser()
    if path.is_file():
        stem = path.name.split(".key")[0] or None
        return _Key(read_key_file(path), stem)
    named = acl.identity_named(value)
    if named is not None:
        return _Key(named, None)
    identity = check_identity(value.strip())
    note = None
    if not is_curve_key(identity):
        note = (
            f"note: {identity!r} is not a CurveZMQ public key (40 Z85 characters) nor a key "
            "name in the ACL: it matches only a transport that names its clients so"
        )
    return _Key(identity, None, note)


def _partitions(values: tuple[str, ...], num_partitions: int) -> list[int]:
    found = []
    for value in values:
        partition = parse_partition(value)
        if partition != EVERY_PARTITION and partition >= num_partitions:
            raise ConfigError(
                f"partition {partition} does not exist: the cluster has partitions 0.."
                f"{num_partitions - 1}",
                key="partition",
            )
        found.append(partition)
    return found


def _shown(partitions: list[int]) -> str:
    return ", ".join(str(partition_label(p)) for p in partitions)


def _state(acl: AccessControl) -> str:
    if acl.enforced:
        return "enforced"
    return "not enforced: every client may do everything until `waltz acl enable`"


# -- changes -----------------------------------------------------------------------------------


@acl_group.command("grant")
@coordination_option
@_key_option
@click.option(
    "--partition", "partitions", multiple=True, required=True, metavar="ID|all",
    help=_partition_help,
)  # fmt: skip
@click.option(
    "--permission", type=_permission_choice, required=True,
    help="read, write (includes read) or admin (includes both).",
)  # fmt: skip
@click.option(
    "--name", default=None, help="A name for the key, shown by `list` (and usable as --key)."
)
def grant(
    uri: str, key: str, partitions: tuple[str, ...], permission: str, name: str | None
) -> None:
    """Grant a key a permission on partitions (kept when it already holds a higher one
    there). Idempotent; does not change whether the ACL is enforced."""
    level = Permission.parse(permission)

    async def work(meta: ClusterAdmin) -> tuple[_Key, list[int], AccessControl]:
        num_partitions = (await meta.config()).num_partitions
        scope = _partitions(partitions, num_partitions)
        stored = await meta.access_control()
        resolved = _resolve_key(key, AccessControl() if stored is None else stored.value)
        label = name if name is not None else resolved.name
        acl = await meta.change_access_control(
            lambda current: current.granted(resolved.identity, scope, level, label)
        )
        return resolved, scope, acl

    resolved, scope, acl = _run(uri, work)
    if resolved.note:
        click.echo(resolved.note, err=True)
    held = ", ".join(
        f"{partition_label(p)}: {acl.keys[resolved.identity].partitions[p].label}" for p in scope
    )
    click.echo(f"key {resolved.identity}{_named(acl, resolved.identity)} now holds {held}")
    click.echo(f"the ACL is {_state(acl)}")


@acl_group.command("revoke")
@coordination_option
@_key_option
@click.option(
    "--partition", "partitions", multiple=True, metavar="ID|all",
    help="A partition id, or 'all' (the grant on every partition); repeatable. "
    "Default: every grant of the key.",
)  # fmt: skip
@click.option(
    "--permission", type=_permission_choice, default=None,
    help="Take away this permission (and those that include it): a grant of it or above "
    "drops to the one below. Default: remove the grants.",
)  # fmt: skip
def revoke(uri: str, key: str, partitions: tuple[str, ...], permission: str | None) -> None:
    """Take a key's permissions away on partitions (every grant of the key by default).
    Idempotent. A grant on 'all' still applies to a partition revoked alone: the output
    says so."""
    level = None if permission is None else Permission.parse(permission)

    async def work(meta: ClusterAdmin) -> tuple[_Key, list[int] | None, AccessControl, int]:
        num_partitions = (await meta.config()).num_partitions
        scope = _partitions(partitions, num_partitions) if partitions else None
        stored = await meta.access_control()
        resolved = _resolve_key(key, AccessControl() if stored is None else stored.value)
        acl = await meta.change_access_control(
            lambda current: current.revoked(resolved.identity, scope, level)
        )
        return resolved, scope, acl, num_partitions

    resolved, scope, acl, num_partitions = _run(uri, work)
    grants = acl.keys.get(resolved.identity)
    if grants is None:
        click.echo(f"key {resolved.identity} holds no permission on any partition")
    else:
        held = ", ".join(
            f"{partition_label(p)}: {grants.partitions[p].label}" for p in sorted(grants.partitions)
        )
        click.echo(f"key {resolved.identity}{_named(acl, resolved.identity)} now holds {held}")
        everywhere = grants.partitions.get(EVERY_PARTITION)
        alone = [p for p in (scope or []) if p != EVERY_PARTITION and p < num_partitions]
        if everywhere is not None and alone:
            click.echo(
                f"note: its grant on all partitions ({everywhere.label}) still applies to "
                f"partition(s) {_shown(alone)}; revoke --partition all to take it away"
            )
    click.echo(f"the ACL is {_state(acl)}")


def _named(acl: AccessControl, identity: str) -> str:
    grants = acl.keys.get(identity)
    return f" ({grants.name})" if grants is not None and grants.name else ""


@acl_group.command("enable")
@coordination_option
def enable(uri: str) -> None:
    """Enforce the ACL on every server: from the next request on, a client is served
    only what its key is granted, a plaintext client nothing."""
    acl = _run(uri, lambda meta: meta.change_access_control(lambda a: a.with_enforced(True)))
    click.echo("the ACL is enforced: a client is served only what its key is granted")
    if not acl.keys:
        click.echo(
            "warning: no key holds any permission: every client request is refused "
            "(`waltz acl grant`)",
            err=True,
        )


@acl_group.command("disable")
@coordination_option
def disable(uri: str) -> None:
    """Stop enforcing the ACL (its grants are kept): every client may do everything."""
    _run(uri, lambda meta: meta.change_access_control(lambda a: a.with_enforced(False)))
    click.echo("the ACL is not enforced: every client may do everything (grants kept)")


# -- reads -------------------------------------------------------------------------------------


@acl_group.command("list")
@coordination_option
@output_option
def list_grants(uri: str, output: str) -> None:
    """Whether the ACL is enforced, and every grant: key, name, partition ('all': every
    partition), permission."""

    async def work(meta: ClusterAdmin) -> dict[str, Any]:
        await meta.config()
        stored = await meta.access_control()
        return describe(None if stored is None else stored.value)

    summary = _run(uri, work)
    if emitted(output, summary):
        return
    if not summary["exists"]:
        click.echo("no ACL: not enforced, every client may do everything")
        return
    click.echo("enforced" if summary["enforced"] else "not enforced (grants kept)")
    if not summary["grants"]:
        click.echo("no grants")
        return
    click.echo(f"{'key':<40}  {'name':<16}  {'partition':<9}  permission")
    for row in summary["grants"]:
        click.echo(
            f"{row['key']:<40}  {row['name'] or '-':<16}  {row['partition']!s:<9}  "
            f"{row['permission']}"
        )


@acl_group.command("check")
@coordination_option
@_key_option
@click.option("--partition", required=True, metavar="ID", help="A partition id.")
@click.option("--permission", type=_permission_choice, required=True, help="read, write or admin.")
@output_option
def check(uri: str, key: str, partition: str, permission: str, output: str) -> None:
    """Whether a key may do what needs a permission on a partition, as the servers
    decide it now. Exit code 0 when it may (it holds the permission, or the ACL is not
    enforced), 3 when it may not, 1 on an error, 2 on a usage error."""
    level = Permission.parse(permission)

    async def work(meta: ClusterAdmin) -> dict[str, Any]:
        num_partitions = (await meta.config()).num_partitions
        (partition_id,) = _partitions((partition,), num_partitions)
        if partition_id == EVERY_PARTITION:
            raise ConfigError("check one partition id, not 'all'", key="partition")
        stored = await meta.access_control()
        acl = AccessControl() if stored is None else stored.value
        resolved = _resolve_key(key, acl)
        held = acl.permission(resolved.identity, partition_id)
        return {
            "key": resolved.identity,
            "partition": partition_id,
            "permission": level.label,
            "held": None if held is None else held.label,
            "enforced": acl.enforced,
            "allowed": acl.allows(resolved.identity, partition_id, level),
        }

    result = _run(uri, work)
    if not emitted(output, result):
        verdict = "may" if result["allowed"] else "may NOT"
        held = result["held"] or "no permission"
        why = f"it holds {held}" if result["enforced"] else "the ACL is not enforced"
        click.echo(
            f"key {result['key']} {verdict} {result['permission']} partition "
            f"{result['partition']} ({why})"
        )
    if not result["allowed"]:
        click.get_current_context().exit(DENIED_EXIT_CODE)
