"""The coordination conformance suite against ``etcd`` (a real 3-member etcd cluster,
started once per test session: the ``etcd_cluster`` fixture of the conformance
pytest plugin) and ``local`` (SQLite files in a temp dir)."""

from __future__ import annotations

from pathlib import Path

import pytest

from waltz_conformance.servers.etcd import EtcdCluster
from waltz_conformance.suites.coordination import CoordinationHarness, CoordinationSuite


@pytest.mark.system
class TestEtcdCoordination(CoordinationSuite):
    @pytest.fixture
    def harness(self, etcd_cluster: EtcdCluster) -> CoordinationHarness:
        from waltz_coord_etcd.conformance import harness as conformance_harness

        etcd_cluster.ensure_all_running()
        return conformance_harness({"cluster": etcd_cluster, "session_timeout": 10.0})


class TestLocalCoordination(CoordinationSuite):
    @pytest.fixture
    def harness(self, tmp_path: Path) -> CoordinationHarness:
        from waltz_coord_local.conformance import harness as conformance_harness

        return conformance_harness({"location": tmp_path, "session_timeout": 3.0})
