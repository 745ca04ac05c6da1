"""The suite's kvfleet processes forked from one that has already imported them (a zygote, as Android and
multiprocessing's forkserver do): an engine is ready in ~1 s instead of ~4.5 s, a gateway in ~0.3 s instead of ~1.5 s,
because torch, transformers, FastAPI and kvfleet's modules (3 s of every start) are imported once per session. The
forked process runs the same `kvfleet` command line (kvfleet.cli.main) with the test's environment; only the
interpreter's start and its imports are shared. Where the test's environment differs from the one the zygote imported
under (a test that sets OMP_NUM_THREADS, say), or KVFLEET_TEST_FORK=0, the process is started the ordinary way.

`python -m tests.forkserver` is the zygote: one request per line on stdin ({"argv", "env", "log"}), the child's pid
per line on stdout; it reaps its children and writes each one's exit status beside its log (`<log>.rc`, as Popen's
returncode: -N for signal N), which ForkedProcess reads.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SWITCH_ENV = "KVFLEET_TEST_FORK"  # 0: every kvfleet process of the suite starts the ordinary way
VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})  # changes per test and is read by nothing the zygote imported


class ForkedProcess:
    """A forked kvfleet process with Popen's poll/wait/send_signal/terminate/kill/returncode/pid."""

    def __init__(self, pid: int, args: list[str], status_path: Path) -> None:
        self.pid, self.args, self._status_path = pid, args, status_path
        self._returncode: int | None = None

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        if self._returncode is None:
            try:
                self._returncode = int(self._status_path.read_text())
            except (OSError, ValueError):
                pass
        return self._returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The client side: starts the zygote on first use, under the environment of that moment."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._env: dict[str, str] = {}
        self._lock = threading.Lock()
        self._logs = Path(tempfile.mkdtemp(prefix="kvfleet-forked-"))
        self._count = 0

    def usable(self) -> bool:
        """Whether a process started now may be forked: the switch is on and the environment is the zygote's."""
        if os.environ.get(SWITCH_ENV, "1") == "0" or not hasattr(os, "fork"):
            return False
        return self._proc is None or _stable(os.environ) == self._env

    def start(self, name: str, args: list[str]) -> tuple[ForkedProcess, Path]:
        """`kvfleet <args>` forked from the zygote; its output goes to the returned log."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver"], cwd=ROOT, text=True,
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                self._env = _stable(os.environ)
                atexit.register(self._proc.stdin.close)  # the zygote exits when its stdin closes
                if self._proc.stdout.readline().strip() != "ready":
                    raise RuntimeError("the suite's fork server did not start")
            self._count += 1
            log = self._logs / f"{name}-{self._count}.log"
            self._proc.stdin.write(json.dumps({"argv": args, "env": dict(os.environ), "log": str(log)}) + "\n")
            self._proc.stdin.flush()
            pid = int(self._proc.stdout.readline())
        return ForkedProcess(pid, ["kvfleet", *args], Path(f"{log}.rc")), log


def _stable(env) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in VOLATILE_ENV}


SERVER = ForkServer()


# ---- the zygote ---------------------------------------------------------------------------------------------------
def _run_child(argv: list[str], env: dict[str, str], log: str) -> None:  # pragma: no cover - in the forked child
    import random

    code = 1
    try:
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        random.seed()  # not the zygote's sequence in every child
        sys.argv = [sys.argv[0], *argv]
        from kvfleet.cli import main

        code = main(argv) or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child's own traceback, in its log, as an exec'd process prints it
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001,S110
                pass
        os._exit(code)


def _serve() -> None:  # pragma: no cover - the zygote's own process
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401

    import kvfleet.cli  # noqa: F401
    import kvfleet.engine.llm_engine  # noqa: F401
    import kvfleet.engine.server.api_server  # noqa: F401
    import kvfleet.engine.server.serve  # noqa: F401
    import kvfleet.gateway.serve  # noqa: F401

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # pytest's Ctrl-C is for pytest; the zygote ends with its stdin
    lock = threading.Lock()
    logs: dict[int, str] = {}

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                time.sleep(0.05)
                continue
            with lock:
                log = logs.pop(pid, None)
            if log is not None:
                tmp = f"{log}.rc.tmp"
                Path(tmp).write_text(str(os.waitstatus_to_exitcode(status)))
                os.replace(tmp, f"{log}.rc")

    threading.Thread(target=reap, daemon=True).start()
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        with lock:
            pid = os.fork()
            if pid == 0:
                _run_child(request["argv"], request["env"], request["log"])
            logs[pid] = request["log"]
        print(pid, flush=True)


if __name__ == "__main__":
    _serve()
