"""The waltz-server tests' shared set-up: a test module may import the helpers of
process_support.py (the ``waltz`` command in its own process, load through the client
library)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
pytest.register_assert_rewrite("process_support")
