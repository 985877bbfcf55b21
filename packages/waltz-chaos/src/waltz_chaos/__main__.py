"""``python -m waltz_chaos``: the same as ``waltz chaos``."""

from waltz_chaos.cli import chaos

chaos(prog_name="waltz chaos")
