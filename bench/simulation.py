"""Simulation speed: simulated seconds per wall second and per CPU second.

Runs seeds of ``waltz simulate``'s default cluster (3 storage nodes, 2 servers, 4
clients, 2 partitions, 40 simulated seconds each) with no faults and with the
``standard`` profile, and prints per profile: simulated seconds per wall second and
per CPU second of this process, the ops and network frames per simulated second,
and, as the reference measured in the same run, the CPU share this process got
(CPU seconds / wall seconds: below 100% when the machine is shared, which slows
the wall-clock figure and not the CPU one). Never pass/fail.

    .venv/bin/python bench/simulation.py [--seeds 10] [--duration 40]
"""

from __future__ import annotations

import argparse
import time

from waltz_sim import SimConfig, run_seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--duration", type=float, default=40.0)
    args = parser.parse_args()
    run_seed(SimConfig(seed=10_000, duration=20.0))  # imports, the codec's generated code
    print(f"{args.seeds} seeds of {args.duration:.0f} simulated seconds per profile")
    for profile in ("none", "standard"):
        wall = cpu = simulated = 0.0
        ops = faults = 0
        for seed in range(args.seeds):
            started_wall, started_cpu = time.perf_counter(), time.process_time()
            result = run_seed(SimConfig(seed=seed, faults=profile, duration=args.duration))
            wall += time.perf_counter() - started_wall
            cpu += time.process_time() - started_cpu
            simulated += result.sim_seconds
            ops += sum(result.outcomes.values())
            faults += result.faults
        print(
            f"  {profile:<9} {simulated / wall:6.1f} simulated s per wall s, "
            f"{simulated / cpu:6.1f} per CPU s; per seed {faults / args.seeds:4.1f} faults, "
            f"{ops / args.seeds:4.0f} ops, {cpu / args.seeds:.2f} CPU s; "
            f"CPU share {cpu / wall:.0%} (reference: 100% on an idle core)"
        )


if __name__ == "__main__":
    main()
