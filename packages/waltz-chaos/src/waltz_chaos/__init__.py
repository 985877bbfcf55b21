"""waltz_chaos: Jepsen-style fault runs on a real Waltz cluster (``waltz chaos``).

A run starts a real cluster (ZooKeeper or etcd, storage nodes on the ``fs``
engine, servers, and client processes running the bank and register workloads
through ``waltz_client``), injects a seeded schedule of faults (kills, pauses,
coordination restarts and session expiries, full disks, and network partitions
between namespaces), then judges the clients' histories and the replicas read back
from every storage node with the simulation's checker (:mod:`waltz_sim.checker`).
It writes a report (text, and an HTML page with the commits over time and the
faults drawn on them). docs/chaos.md describes it.
"""
