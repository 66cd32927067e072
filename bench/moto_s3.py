"""A local S3-compatible endpoint: moto in server mode on 127.0.0.1, as its own process.

The one launcher shared by the bench (the dataset rows, through `harness.Context.s3`) and the
tests (the `s3` fixture in tests/conftest.py, which puts bench/ on its path for this module).
It imports only the standard library (boto3 when a bucket is made), nothing from the bench
or from the product, so importing it brings nothing else along.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO


class S3Server:
    """moto in server mode on a free 127.0.0.1 port. `environment` holds the standard AWS
    variables that point clients (fsspec/s3fs, boto3) at it."""

    def __init__(
        self,
        *,
        log_path: Path | None = None,
        niceness: int = 0,
        access_key: str = "testing",
        startup_timeout: float = 30.0,
    ) -> None:
        """Start the server and wait until it answers.

        Args:
            log_path: File for the server's output; None discards it.
            niceness: Run the server under ``nice -n`` this (the bench uses 19: in a
                deployment the object store runs elsewhere, so its CPU should not be what a
                row measures).
            access_key: The access key id and secret the clients are given (moto takes any).
            startup_timeout: Seconds to wait for the server to answer.
        """
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._access_key = access_key
        # Closed in stop().
        self._log: IO[str] | None = None if log_path is None else open(log_path, "w")
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        if niceness:
            command = ["nice", "-n", str(niceness), *command]
        self.process = subprocess.Popen(
            command,
            stdout=self._log if self._log is not None else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        self.environment = {
            "AWS_ACCESS_KEY_ID": access_key,
            "AWS_SECRET_ACCESS_KEY": access_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
        }
        deadline = time.monotonic() + startup_timeout
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"moto server did not start on {self.endpoint}") from None
                time.sleep(0.1)

    def make_bucket(self, name: str) -> str:
        """Create a bucket; returns its ``s3://`` URI."""
        import boto3

        boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self._access_key,
            aws_secret_access_key=self._access_key,
        ).create_bucket(Bucket=name)
        return f"s3://{name}"

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s)."""
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self._log is not None:
            self._log.close()
