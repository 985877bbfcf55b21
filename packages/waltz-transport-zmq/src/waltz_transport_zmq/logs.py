"""Log lines about peers, rate-limited (re-exported: the class lives in waltz_api, where
the server and the storage node use it too)."""

from waltz_api.peerlog import PeerLog

__all__ = ["PeerLog"]
