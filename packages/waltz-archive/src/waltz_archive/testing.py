"""A real S3-compatible server for tests and benchmarks: moto's standalone server
(``pip install 'waltz-archive[test]'``), started as a process on a free loopback port,
stopped by its pid. :meth:`S3Server.pause` (SIGSTOP) makes the archive unreachable
without losing what it holds (moto keeps its objects in memory); :meth:`resume`
brings it back."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from waltz_api.ports import free_port

KEY = "testing"
SECRET = "testing"  # moto accepts any credentials; these are no secret
REGION = "us-east-1"


class S3Server:
    """moto's S3 server on 127.0.0.1 (``with S3Server(dir) as s3: s3.url("bucket")``)."""

    def __init__(self, workdir: Path, start_timeout: float = 60.0) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.start_timeout = start_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / f"s3-{self.port}.log"

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
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET},
            )
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the S3 server exited at start ({self.log_path}: "
                    f"{self.log_path.read_text(errors='replace')[-2000:]})"
                )
            try:
                with urllib.request.urlopen(self.endpoint_url, timeout=2):
                    return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the S3 server did not answer within {self.start_timeout}s")

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
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGCONT)
            process.kill()
        process.wait(timeout=30)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
