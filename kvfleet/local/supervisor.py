"""One way to run the fleet's processes: start a child with its output in a log, wait until it is ready (or report
its early exit with the log's last lines), and stop children in reverse start order, SIGKILL after a timeout.

A child started in a session of its own owns its whole process tree, as a container owns its cgroup: once it has
exited (stopped, or died and about to be started again), whatever it started and left behind (vLLM's EngineCore and
workers, a resource tracker) is killed with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

Readiness = str | Callable[[], bool]  # an HTTP path under the child's URL that answers 200, or a check


class ChildExited(RuntimeError):
    """A child exited while it was expected to run (its message ends with the last lines of its log)."""


class NotReady(RuntimeError):
    """A child did not become ready in time."""


def kvfleet_command(*args: str) -> list[str]:
    """`kvfleet <args>` as this Python's module, so a child runs the same installation as its parent."""
    return [sys.executable, "-m", "kvfleet.cli", *args]


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except OSError:
        return False


@dataclass(eq=False)  # a process is itself, as a Popen is
class Child:
    """A started process with its name, URL and log; it answers Popen's poll/wait/send_signal/terminate/kill."""

    name: str
    proc: subprocess.Popen
    url: str
    log_path: Path | None  # None: the log is an anonymous temporary file, read through output()
    group: str = ""  # children of one group stop together
    tail_lines: int = 20
    _log: IO[bytes] | None = field(default=None, repr=False)
    owns_tree: bool = False  # started in a session of its own: its process group is its tree

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def terminate(self) -> None:
        self.proc.terminate()

    def kill(self) -> None:
        self.proc.kill()

    def end_tree(self) -> None:
        """Once the child has exited: SIGKILL to what it left running in its process group (nothing to do for a
        child that shares its parent's group). Called at once, while the group still exists: its id is the child's
        pid, which the kernel does not give another process while any member of the group lives."""
        if not self.owns_tree or self.poll() is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # no member left
            pass

    def output(self) -> str:
        """Everything the child has written so far."""
        if self._log is not None:  # pread leaves the offset the child writes at alone
            fd = self._log.fileno()
            return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")
        try:
            return self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            return "(no log)"

    def tail(self, lines: int | None = None) -> str:
        return "\n".join(self.output().splitlines()[-(lines or self.tail_lines):])

    def check_running(self) -> None:
        """Raises ChildExited, with the end of the log, if the child has exited."""
        if self.poll() is not None:
            where = f" ({self.log_path})" if self.log_path else ""
            raise ChildExited(f"{self.name} exited with {self.returncode}; the end of its log{where}:\n{self.tail()}")

    def wait_ready(self, ready: Readiness = "/ready", timeout_s: float = 300.0, poll_s: float = 0.1) -> None:
        """Until `ready` holds; ChildExited if the child exits first, NotReady after `timeout_s`."""
        check = (lambda: http_ok(self.url + ready)) if isinstance(ready, str) else ready
        if not wait_until(check, [self], timeout_s, poll_s):
            where = f"; see {self.log_path}" if self.log_path else f"; the end of its log:\n{self.tail()}"
            raise NotReady(f"{self.name} was not ready after {timeout_s:.0f} s{where}")

    def stop(self, timeout_s: float = 30.0) -> None:
        stop_together([self], timeout_s)


def spawn(name: str, argv: list[str], *, url: str = "", log_dir: Path | None = None,
          env: dict[str, str] | None = None, new_session: bool = True, group: str = "",
          tail_lines: int = 20) -> Child:
    """Starts argv with stdout and stderr in <log_dir>/<name>.log (or an anonymous file when log_dir is None).
    `new_session` keeps a terminal's Ctrl-C away from the child, so that its parent orders the stop."""
    if log_dir is None:
        log: IO[bytes] = tempfile.TemporaryFile()  # a file, not a pipe: a pipe nobody reads fills and blocks
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=new_session)
        return Child(name, proc, url, None, group or name, tail_lines, log, owns_tree=new_session)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=new_session)
    return Child(name, proc, url, log_path, group or name, tail_lines, owns_tree=new_session)


def previous_log(log_path: Path) -> Path:
    """Where Supervisor.replace keeps the log of a child's previous run."""
    return log_path.with_name(f"{log_path.stem}.previous{log_path.suffix}")


def wait_until(check: Callable[[], bool], watched: Iterable[Child], timeout_s: float, poll_s: float = 0.1) -> bool:
    """Polls check() until it holds (True) or `timeout_s` passes (False); ChildExited if a watched child exits."""
    watched = list(watched)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in watched:
            child.check_running()
        if check():
            return True
        time.sleep(poll_s)
    return False


def stop_together(children: Iterable[Child], timeout_s: float = 30.0) -> None:
    """SIGTERM to every child still running, then a shared `timeout_s` to exit before SIGKILL; then what each left
    running in its process tree goes too."""
    children = list(children)
    running = [c for c in children if c.poll() is None]
    for child in running:
        child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in running:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    for child in children:
        child.end_tree()


class Supervisor:
    """The children of one fleet: started in order, stopped in reverse order (a group's children together)."""

    def __init__(self, log_dir: Path | None = None, *, env: dict[str, str] | None = None,
                 new_session: bool = True, tail_lines: int = 20) -> None:
        self.log_dir, self.env, self.new_session, self.tail_lines = log_dir, env, new_session, tail_lines
        self.children: list[Child] = []

    def start(self, name: str, argv: list[str], *, url: str = "", env: dict[str, str] | None = None,
              group: str = "") -> Child:
        child = spawn(name, argv, url=url, log_dir=self.log_dir, env=env if env is not None else self.env,
                      new_session=self.new_session, group=group, tail_lines=self.tail_lines)
        self.children.append(child)
        return child

    def replace(self, old: Child, argv: list[str], *, env: dict[str, str] | None = None) -> Child:
        """`old` (exited) started again as a new child of its name, URL and group, in its place in the stop order;
        old's log is kept beside the new one as <name>.previous.log (as `kubectl logs --previous` keeps it)."""
        old.end_tree()  # what the old process left running (a vLLM engine core holding its memory) goes first
        if old.log_path is not None and old.log_path.exists():
            old.log_path.replace(previous_log(old.log_path))
        new = spawn(old.name, argv, url=old.url, log_dir=self.log_dir, env=env if env is not None else self.env,
                    new_session=self.new_session, group=old.group, tail_lines=self.tail_lines)
        if old in self.children:
            self.children[self.children.index(old)] = new
        else:
            self.children.append(new)
        return new

    def wait_until(self, check: Callable[[], bool], what: str, timeout_s: float, poll_s: float = 0.1) -> None:
        """Until check() holds, while every child runs; NotReady names `what` after `timeout_s`."""
        if not wait_until(check, self.children, timeout_s, poll_s):
            where = f"; logs in {self.log_dir}" if self.log_dir else ""
            raise NotReady(f"no {what} after {timeout_s:.0f} s{where}")

    def prune(self) -> None:
        """Forgets the children that have exited (polling them reaps them), and ends what they left running."""
        for child in self.children:
            child.end_tree()  # a no-op for a child still running
        self.children = [c for c in self.children if c.poll() is None]

    def stop(self, timeout_s: float = 30.0) -> None:
        """The newest group first; each group gets SIGTERM together and `timeout_s` before SIGKILL."""
        while self.children:
            group = self.children[-1].group
            batch = []
            while self.children and self.children[-1].group == group:
                batch.append(self.children.pop())
            stop_together(batch, timeout_s)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
