"""Fixtures of the waltz-sim tests: the helper modules (sim_support.py, seeds/planted.py)
on the path."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "seeds"))  # planted.py
