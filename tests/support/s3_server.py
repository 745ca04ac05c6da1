"""An S3-compatible server on loopback for the Batch API's object-store tests: moto's server mode, which speaks S3's
HTTP API (buckets, objects, multipart uploads) from memory. It is an emulator: no real S3, MinIO or Ceph can run on
this machine (none is on PyPI), so this is the closest real part. It comes from PyPI in a venv of its own, as the
peer routers do: botocore, which moto needs, wants python-dateutil < 3 and the kubernetes client wants >= 3.

    python -m tests.support.s3_server install     # scripts/test.sh runs it; nothing to do when the pinned set is there
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvfleet.fleet.ports import free_port

REQUIREMENTS = ("moto[s3]==5.2.5", "flask==3.1.3", "flask-cors==6.0.5")  # moto's server mode needs flask
VENV = Path(os.environ.get("KVFLEET_S3_SERVER_VENV",
                           Path.home() / ".cache" / "kvfleet" / "runtimes" / "moto-5.2.5"))
SERVER = VENV / "bin" / "moto_server"
INSTALL = "python -m tests.support.s3_server install"


def installed() -> bool:
    return SERVER.exists()


def install() -> None:
    if installed():
        return
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", *REQUIREMENTS], check=True)


class S3Server:
    """One moto server process; `env()` is what a client needs to reach it (obstore reads these variables)."""

    def __init__(self) -> None:
        if not installed():
            raise RuntimeError(f"the S3-compatible test server is not installed: run `{INSTALL}`")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> S3Server:
        self.proc = subprocess.Popen([str(SERVER), "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                httpx.get(self.url, timeout=2)
                return self
            except httpx.HTTPError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not answer on {self.url}") from None
                time.sleep(0.2)

    def create_bucket(self, name: str) -> None:
        httpx.put(f"{self.url}/{name}", timeout=10).raise_for_status()

    def keys(self, bucket: str) -> list[str]:
        """The bucket's keys (S3's ListObjectsV2, first 1,000)."""
        import re

        listing = httpx.get(f"{self.url}/{bucket}", params={"list-type": "2"}, timeout=10)
        listing.raise_for_status()
        return re.findall(r"<Key>([^<]+)</Key>", listing.text)

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ALLOW_HTTP": "true", "AWS_REGION": "us-east-1",
                "AWS_ACCESS_KEY_ID": "kvfleet-test", "AWS_SECRET_ACCESS_KEY": "kvfleet-test"}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit(f"usage: {INSTALL}")
    install()
    print(f"moto_server: {SERVER}")
