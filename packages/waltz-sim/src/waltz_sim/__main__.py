"""``python -m waltz_sim``: the same as ``waltz simulate``."""

from waltz_sim.cli import main

main()
