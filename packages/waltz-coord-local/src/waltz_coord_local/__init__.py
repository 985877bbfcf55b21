"""Waltz coordination embedded in a SQLite file, shared by the processes of one machine."""

from __future__ import annotations

from waltz_coord_local.coordination import LocalCoordination, parse_location, resolve_location

__all__ = ["LocalCoordination", "parse_location", "resolve_location"]
