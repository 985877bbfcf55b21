"""A real S3-compatible server for tests and benchmarks: moto's standalone server
(``pip install 'waltz-archive[test]'``), started as a process on a free loopback port,
stopped by its pid. :meth:`S3Server.pause` (SIGSTOP) makes the archive unreachable
without losing what it holds (moto keeps its objects in memory); :meth:`resume`
brings it back."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from waltz_api.ports import free_port
from waltz_api.supervised import SupervisedProcess

KEY = "testing"
SECRET = "testing"  # moto accepts any credentials; these are no secret
REGION = "us-east-1"


class S3Server:
    """moto's S3 server on 127.0.0.1 (``with S3Server(dir) as s3: s3.url("bucket")``)."""

    def __init__(self, workdir: Path, start_timeout: float = 60.0) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.start_timeout = start_timeout
        self.log_path = workdir / f"s3-{self.port}.log"
        self.child = SupervisedProcess(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            self.log_path,
            name="the S3 server",
            env={**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET},
        )

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self.child.process

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """The fsspec (s3fs) options of an archive on this server."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"region_name": REGION},
        }

    def url(self, bucket: str, prefix: str = "waltz") -> str:
        return f"s3://{bucket}/{prefix}"

    def start(self) -> S3Server:
        """Start it and wait until it answers HTTP (ProcessStartError with its log when it
        exits or does not answer within ``start_timeout``)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.child.start()
        try:
            self.child.wait_ready_sync(
                self._answers,
                timeout=self.start_timeout,
                interval=0.1,
                waiting_for=f"an HTTP answer at {self.endpoint_url}",
            )
        except BaseException:
            self.stop()
            raise
        return self

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint_url, timeout=2):
                return True
        except (urllib.error.URLError, OSError):
            return False

    def create_bucket(self, bucket: str) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True)
        fs.call_s3("create_bucket", Bucket=bucket)

    def filesystem(self) -> Any:
        """An s3fs file system of this server (a test's own view, uncached)."""
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): requests hang until :meth:`resume`."""
        assert self.child.running, "the S3 server is not running"
        self.child.pause()

    def resume(self) -> None:
        self.child.resume()

    def stop(self) -> None:
        """Kill it (by its pid; what it held in memory is gone)."""
        self.child.kill()

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
