"""Deterministic simulation of a whole Waltz cluster (``waltz simulate``).

The real server, storage node and client run together in one process and one
event loop on virtual time (:mod:`waltz_sim.loop`); only the contracts are
simulated (:mod:`waltz_sim.net`, :mod:`waltz_sim.coord`, :mod:`waltz_sim.disk`),
with faults chosen by a seed (:mod:`waltz_sim.faults`). Workloads
(:mod:`waltz_sim.workloads`) record a history that the checker
(:mod:`waltz_sim.checker`, usable on its own) judges. :func:`run_seed` runs one seed.
"""

from typing import TYPE_CHECKING

from waltz_api.lazy import lazy_exports

if TYPE_CHECKING:
    from waltz_sim.runner import SeedResult, run_seed
    from waltz_sim.world import SimConfig

__all__ = ["SeedResult", "SimConfig", "run_seed"]
# imported on first use: `waltz` imports this package for its entry point (commands.py)
__getattr__, __dir__ = lazy_exports(
    __name__, {"SeedResult": ".runner", "run_seed": ".runner", "SimConfig": ".world"}
)
