"""Fixtures of the waltz-client tests (helpers live in client_support.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from client_support import any_peer, cluster, peer

__all__ = ["any_peer", "cluster", "peer"]
