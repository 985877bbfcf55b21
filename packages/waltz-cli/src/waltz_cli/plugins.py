"""``waltz plugins``: what is installed, by kind."""

from __future__ import annotations

from typing import Any

import click

from waltz_api.hookspecs import PluginKind
from waltz_api.plugins import get_registry
from waltz_cli.output import emit, output_option


@click.group("plugins")
def plugins_group() -> None:
    """Installed plugins (storage engines, coordination, transports, lock tables)."""


@plugins_group.command("list")
@output_option
def list_plugins(output: str) -> None:
    """List every installed plugin by kind, with its package, version and capabilities."""
    registry = get_registry()
    rows = []
    for kind in PluginKind:
        for d in registry.descriptors(kind):
            distribution, version = registry.distribution(d)
            rows.append(
                {
                    "kind": kind.value,
                    "name": d.name,
                    "package": distribution,
                    "version": version,
                    "capabilities": sorted(d.capabilities),
                    "uri_schemes": list(d.uri_schemes),
                    "description": d.description,
                }
            )
    emit(output, rows, lambda: _text(rows))
    for name, error in sorted(registry.load_errors.items()):
        click.echo(f"failed to load plugin {name!r}: {error}", err=True)


def _text(rows: list[dict[str, Any]]) -> None:
    for kind in PluginKind:
        click.echo(f"{kind.value}:")
        names = [r for r in rows if r["kind"] == kind.value]
        if not names:
            click.echo("  (none)")
        for row in names:
            caps = ", ".join(row["capabilities"]) or "-"
            where = f"{row['package']} {row['version']}"
            click.echo(
                f"  {row['name']:<12} {where:<28} capabilities: {caps}  {row['description']}"
            )
