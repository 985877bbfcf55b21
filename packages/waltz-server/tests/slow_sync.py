"""A slow disk for one process, in test code: run a ``PYTHON -m MODULE ARGS...`` command
line in this interpreter with every ``os.fdatasync`` and ``os.fsync`` taking DELAY
seconds longer while the file FLAG exists (the call then runs as usual)::

    python slow_sync.py FLAG DELAY PYTHON -m waltz_cli storage --config FILE

It is meant as the ``wrap`` of a :class:`~waltz_storage_node.testing.StorageNodeProcess`
(``[sys.executable, "slow_sync.py", FLAG, "1.5"]``): the node is the real ``waltz
storage``, its `fs` engine's flushes slow as on a disk that takes that long to sync (its
writes, reads and the network are untouched). Creating FLAG makes the disk slow;
removing it ends the stall, also of a sync waiting meanwhile (the flag is looked at
every 10 ms). Nothing in the package uses it.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from collections.abc import Callable


def slowed(call: Callable[[int], None], flag: str, delay: float) -> Callable[[int], None]:
    def slow(fd: int) -> None:
        until = time.monotonic() + delay
        while os.path.exists(flag) and time.monotonic() < until:
            time.sleep(0.01)
        call(fd)

    return slow


if __name__ == "__main__":
    if len(sys.argv) < 6 or sys.argv[4] != "-m":
        sys.exit("usage: slow_sync.py FLAG DELAY PYTHON -m MODULE [ARGS...]")
    flag, delay = sys.argv[1], float(sys.argv[2])
    module, args = sys.argv[5], sys.argv[6:]
    os.fdatasync = slowed(os.fdatasync, flag, delay)
    os.fsync = slowed(os.fsync, flag, delay)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
