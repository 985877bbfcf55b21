"""Shared: a real Waltz cluster per test module and one real local Spark session
(local[2], loopback) for the run."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from waltz_spark.testing import BackgroundCluster

sys.path.insert(0, str(Path(__file__).parent))  # the modules share helpers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundCluster]:
    running = BackgroundCluster(tmp_path_factory.mktemp("waltz"))
    try:
        running.start()
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One Spark JVM for the whole run (starting one takes seconds)."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    import waltz_spark

    session = (
        SparkSession.builder.master("local[2]")
        .appName("waltz-spark-tests")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    try:
        waltz_spark.register(session)
        yield session
    finally:
        from pyspark import SparkContext

        gateway = SparkContext._gateway
        session.stop()
        # the JVM this session started: stopped by its pid (py4j leaves it to exit)
        proc = getattr(gateway, "proc", None)
        if gateway is not None:
            gateway.shutdown()
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        SparkContext._gateway = None
        SparkContext._jvm = None
