"""The ACL of an ``acl`` seed (``SimConfig.acl = "on"``): who may write where.

The cluster's ACL (``waltz_api.access``, ``waltz acl``) is created enforced with the
cluster. Every client connects with its process name as its identity (the ``sim``
transport's ``identity`` option, what a CurveZMQ handshake proves in production;
``SimConnection.peer_identity`` on the server's end). Every client may read every
partition and write it, except the last client, which may write partition 0 only:
its ops on the other partitions must be refused (``AccessDeniedError``), never
committed; nobody else's may be refused (``acl-refused-committed`` and
``acl-wrongly-refused``, :mod:`waltz_sim.checker.access`). The read-back at the end
reads as :data:`READER`, which may only read.
"""

from __future__ import annotations

from waltz_api.access import EVERY_PARTITION, AccessControl, Permission

READER = "read-back"
"""The identity of the client that reads the cluster back at the end."""


def refused(clients: int, partitions: int) -> frozenset[tuple[str, int]]:
    """The (client, partition) pairs whose appends the ACL refuses."""
    last = f"client-{clients - 1}"
    return frozenset((last, p) for p in range(1, partitions))


def access_control(clients: int, partitions: int) -> AccessControl:
    """The enforced ACL of an ``acl`` seed."""
    acl = AccessControl(enforced=True).granted(READER, [EVERY_PARTITION], Permission.READ)
    denied = refused(clients, partitions)
    for i in range(clients):
        name = f"client-{i}"
        acl = acl.granted(name, [EVERY_PARTITION], Permission.READ, name=name)
        writable = [p for p in range(partitions) if (name, p) not in denied]
        if len(writable) == partitions:
            acl = acl.granted(name, [EVERY_PARTITION], Permission.WRITE)
        elif writable:
            acl = acl.granted(name, writable, Permission.WRITE)
    return acl


__all__ = ["READER", "access_control", "refused"]
