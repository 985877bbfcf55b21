"""The file a running ``waltz dev`` cluster leaves in its data directory, naming its
endpoints and coordination URI (written by ``waltz_dev.dev``, read by any command
that defaults to the dev cluster of the current directory, such as ``waltz client``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

READY_FILE = "waltz-dev.ready.json"
DEFAULT_DEV_DIR = ".waltz-dev"
"""Where ``waltz dev`` keeps its cluster unless told otherwise (``--data-dir``)."""


def read_ready_file(data_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The endpoints of the dev cluster running in ``data_dir``, or None when none runs."""
    path = Path(data_dir) / READY_FILE
    try:
        info: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not alive(int(info.get("pid", -1))):
        return None
    return info


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
