"""Fixtures of the waltz-client tests (helpers live in client_support.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
pytest.register_assert_rewrite("scenarios")

from client_support import any_peer, cluster, peer  # noqa: E402 - after the path and rewrite setup

__all__ = ["any_peer", "cluster", "peer"]
