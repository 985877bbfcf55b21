"""Waltz coordination on etcd v3, through etcd's JSON gRPC gateway (see the README)."""

from __future__ import annotations

from waltz_coord_etcd.coordination import EtcdCoordination, EtcdTarget, parse_connect

__all__ = ["EtcdCoordination", "EtcdTarget", "parse_connect"]
