"""The peer routers the overhead benchmark runs beside kvfleet's gateway, each from PyPI in its own virtual
environment under ~/.cache/kvfleet-bench/venvs/<name> (they pin their own dependencies, so none go into kvfleet's).

    python -m bench.peers install                 # all of them; or name some: install smg vllm-router
    python -m bench.peers versions

Each is a Rust router behind a Python entry point, started in front of one kvfleet engine with round-robin (with one
worker every policy picks the same engine; round-robin is the cheapest pick each offers) and its log at warning
level, so that what is measured is the proxying, not a log line written per request.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvfleet.fleet.ports import free_port
from kvfleet.local.supervisor import Child
from kvfleet.local.supervisor import spawn as spawn_child

VENVS = Path(os.environ.get("KVFLEET_BENCH_VENVS", Path.home() / ".cache" / "kvfleet-bench" / "venvs"))


@dataclass(frozen=True)
class Peer:
    """One router: its PyPI requirement (pinned), the command that starts it with worker URLs, its flags."""

    name: str
    requirement: str
    command: tuple[str, ...]  # the entry point in the venv's bin/, then its subcommand
    extra: tuple[str, ...] = ()

    @property
    def venv(self) -> Path:
        return VENVS / self.name

    @property
    def package(self) -> str:
        return self.requirement.split("==")[0]

    def installed(self) -> bool:
        return (self.venv / "bin" / self.command[0]).exists()

    def version(self) -> str | None:
        """The version installed in its venv, or None when it is not installed."""
        if not self.installed():
            return None
        script = f"import importlib.metadata as m; print(m.version({self.package!r}))"
        out = subprocess.run([str(self.venv / "bin" / "python"), "-c", script], capture_output=True, text=True)
        return out.stdout.strip() or None

    def argv(self, engine_urls: list[str], port: int | str, metrics_port: int | str, policy: str = "round_robin"
             ) -> list[str]:
        """Its command line; with no engine URLs it starts with no workers (they are registered later)."""
        workers = ["--worker-urls", *engine_urls] if engine_urls else []
        return [str(self.venv / "bin" / self.command[0]), *self.command[1:], "--host", "127.0.0.1",
                "--port", str(port), *workers, "--policy", policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), *self.extra]


PEERS: dict[str, Peer] = {peer.name: peer for peer in (
    # The Shepherd Model Gateway, sglang-router's successor. Without a model path it would try to fetch a tokenizer
    # named after the served model; a pure load balancer needs none.
    Peer("smg", "smg==1.13.0", ("smg", "launch"), ("--log-level", "warn", "--disable-tokenizer-autoload")),
    Peer("sglang-router", "sglang-router==0.3.2", ("sglang-router", "launch"), ("--log-level", "warn")),
    Peer("vllm-router", "vllm-router==0.1.17", ("vllm-router",), ("--log-level", "warning")),
)}


def installed_peers() -> list[str]:
    return [name for name, peer in PEERS.items() if peer.installed()]


def install(peer: Peer) -> None:
    """A fresh venv with the pinned requirement (nothing to do when the pinned version is there); pip's output on
    failure."""
    if peer.version() == peer.requirement.split("==")[1]:
        return
    subprocess.run([sys.executable, "-m", "venv", str(peer.venv)], check=True)
    subprocess.run([str(peer.venv / "bin" / "pip"), "install", "-q", peer.requirement], check=True)


def answers_chat(url: str, model: str) -> bool:
    """A 1-token chat completion through `url` comes back 200: the router has registered its worker."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1})
    request = urllib.request.Request(url + "/v1/chat/completions", body.encode(),
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def start(peer: Peer, engine_urls: list[str], model: str, log_dir: Path, timeout_s: float = 60.0,
          policy: str = "round_robin") -> Child:
    """The router in front of the engines, once it answers a completion; its log's end if it exits or never does."""
    port = free_port()
    child = spawn_child(peer.name, peer.argv(engine_urls, port, free_port(), policy), url=f"http://127.0.0.1:{port}",
                        log_dir=log_dir)
    try:
        child.wait_ready(lambda: answers_chat(child.url, model), timeout_s, poll_s=0.3)
    except BaseException:
        child.stop()
        raise
    return child


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("install", "versions"):
        print(__doc__)
        return 2
    names = argv[1:] or list(PEERS)
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        print(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEERS)}")
        return 2
    for name in names:
        if argv[0] == "install":
            try:
                install(PEERS[name])
            except subprocess.CalledProcessError as exc:
                print(f"{name}: installing {PEERS[name].requirement} failed ({shlex.join(exc.cmd)} exited "
                      f"{exc.returncode}; its output is above)")
                return 1
        print(f"{name}: {PEERS[name].version() or 'not installed'} ({PEERS[name].venv})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
