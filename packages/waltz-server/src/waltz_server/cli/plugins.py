"""``waltz plugins``: what is installed, by kind."""

from __future__ import annotations

import json

import click

from waltz_api.hookspecs import PluginKind
from waltz_api.plugins import get_registry


@click.group("plugins")
def plugins_group() -> None:
    """Installed plugins (storage engines, coordination, transports, lock tables)."""


@plugins_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_plugins(as_json: bool) -> None:
    """List every installed plugin by kind, with its capabilities."""
    registry = get_registry()
    rows = [
        {
            "kind": kind.value,
            "name": d.name,
            "capabilities": sorted(d.capabilities),
            "uri_schemes": list(d.uri_schemes),
            "description": d.description,
        }
        for kind in PluginKind
        for d in registry.descriptors(kind)
    ]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for kind in PluginKind:
        click.echo(f"{kind.value}:")
        names = [r for r in rows if r["kind"] == kind.value]
        if not names:
            click.echo("  (none)")
        for row in names:
            caps = ", ".join(row["capabilities"]) or "-"
            click.echo(f"  {row['name']:<12} capabilities: {caps}  {row['description']}")
    for name, error in sorted(registry.load_errors.items()):
        click.echo(f"failed to load plugin {name!r}: {error}", err=True)
