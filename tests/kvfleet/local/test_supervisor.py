"""The process supervisor with real child processes (small `python -c` scripts): readiness over HTTP or a check,
an early exit reported with the end of the log, a child that ignores SIGTERM killed after the timeout, and the
stop order (newest first, a group signalled together, each group gone before the next is signalled)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from kvfleet.local.supervisor import ChildExited, NotReady, Supervisor, spawn
from tests.conftest import free_port
from tests.support.polling import until
from tests.support.processes import alive

# On SIGTERM: note it, take `linger` seconds (as an engine draining), note the exit, exit 0.
STOPPABLE = """
import signal, sys, time
name, events, linger = sys.argv[1], sys.argv[2], float(sys.argv[3])
def note(what):
    with open(events, "a") as f:
        f.write(f"{name} {what}\\n")
def on_term(signum, frame):
    note("got SIGTERM")
    time.sleep(linger)
    note("exits")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print(name, "running", flush=True)
while True:
    time.sleep(1)
"""


def python(script: str, *args: str) -> list[str]:
    return [sys.executable, "-c", script, *args]


def test_a_child_is_ready_when_its_http_path_answers_and_its_output_is_in_its_log(tmp_path: Path) -> None:
    port = free_port()
    with Supervisor(tmp_path) as procs:
        server = procs.start("web", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                             url=f"http://127.0.0.1:{port}")
        server.wait_ready("/", timeout_s=60)
        assert server.poll() is None
        procs.wait_until(lambda: '"GET / HTTP/1.1" 200' in server.output(), "logged request", timeout_s=30)
        assert '"GET / HTTP/1.1" 200' in (tmp_path / "web.log").read_text()
    assert server.poll() is not None  # leaving the block stopped it


def test_a_child_is_ready_when_a_check_holds(tmp_path: Path) -> None:
    flag = tmp_path / "loaded"
    child = spawn("loader", python("import sys, time; time.sleep(0.5); open(sys.argv[1], 'w').close(); "
                                   "time.sleep(60)", str(flag)))
    try:
        child.wait_ready(flag.exists, timeout_s=60)
        assert flag.exists() and child.poll() is None
    finally:
        child.stop(timeout_s=5)


def test_an_early_exit_is_reported_with_the_end_of_its_log(tmp_path: Path) -> None:
    crash = ("import sys\nfor i in range(50): print('loading layer', i)\n"
             "print('no model at /nowhere; pass --model', file=sys.stderr)\nsys.exit(3)")
    with Supervisor(tmp_path) as procs:
        engine = procs.start("engine-0", python(crash), url=f"http://127.0.0.1:{free_port()}")
        with pytest.raises(ChildExited) as err:
            engine.wait_ready("/ready", timeout_s=60)
    message = str(err.value)
    assert "engine-0 exited with 3" in message and str(tmp_path / "engine-0.log") in message
    assert message.rstrip().endswith("no model at /nowhere; pass --model")
    assert "loading layer 49" in message and "loading layer 0\n" not in message  # the end, not all of it


def test_a_child_that_never_gets_ready_times_out_with_its_log_end() -> None:
    child = spawn("slow", python("print('still loading', flush=True); import time; time.sleep(60)"))
    try:
        child.wait_ready(lambda: "still loading" in child.output(), timeout_s=60)
        with pytest.raises(NotReady, match="slow was not ready after 1 s; the end of its log:\nstill loading"):
            child.wait_ready(lambda: False, timeout_s=1)
        assert child.poll() is None  # the caller decides what to do with it
    finally:
        child.stop(timeout_s=5)


def test_a_child_that_ignores_sigterm_is_killed_after_the_timeout() -> None:
    stubborn = spawn("stubborn", python("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                        "print('ready', flush=True); time.sleep(120)"))
    stubborn.wait_ready(lambda: "ready" in stubborn.output(), timeout_s=60)
    stubborn.stop(timeout_s=0.5)
    assert stubborn.returncode == -signal.SIGKILL


def test_children_stop_newest_group_first_and_a_group_together(tmp_path: Path) -> None:
    events = tmp_path / "events"
    procs = Supervisor(tmp_path)
    started = []
    for name, group, linger in [("redis", "", "0"), ("engine-0", "engines", "1"), ("engine-1", "engines", "1"),
                                ("gateway", "", "0.5")]:
        child = procs.start(name, python(STOPPABLE, name, str(events), linger), group=group)
        started.append(child)
    for child in started:
        child.wait_ready(lambda c=child: "running" in c.output(), timeout_s=60)
    procs.stop(timeout_s=30)
    lines = events.read_text().splitlines()
    assert lines[:2] == ["gateway got SIGTERM", "gateway exits"]
    assert sorted(lines[2:4]) == ["engine-0 got SIGTERM", "engine-1 got SIGTERM"]  # both before either exits
    assert sorted(lines[4:6]) == ["engine-0 exits", "engine-1 exits"]
    assert lines[6:] == ["redis got SIGTERM", "redis exits"]
    assert all(child.returncode == 0 for child in started) and procs.children == []


# A process that starts a helper of its own (as vLLM's API server starts its EngineCore) and writes the helper's pid.
WITH_HELPER = """
import subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
with open(sys.argv[1], "w") as f:
    f.write(str(helper.pid))
print("running", flush=True)
time.sleep(300)
"""



@pytest.mark.parametrize("end", ["restarted", "stopped", "pruned"])
def test_a_child_that_dies_leaves_nothing_of_its_tree_running(tmp_path: Path, end: str) -> None:
    """SIGKILL takes only the process it is sent to: what it started lives on, orphaned, holding its memory (a vLLM
    engine's EngineCore kept 2.7 GB). As a kubelet kills a container's cgroup, the supervisor kills the child's
    process group before starting it again, when it forgets it, and when it stops."""
    procs = Supervisor(tmp_path)
    helper_pid = tmp_path / "helper.pid"
    child = procs.start("engine-0", python(WITH_HELPER, str(helper_pid)))
    child.wait_ready(lambda: "running" in child.output() and helper_pid.exists(), timeout_s=60)
    helper = int(helper_pid.read_text())
    child.kill()
    child.wait()
    assert alive(helper)  # orphaned, still running
    try:
        if end == "restarted":  # the local fleet's restart
            procs.replace(child, python("import time; time.sleep(300)"))
        elif end == "pruned":  # the local kubelet forgets a deleted Pod's process once it exited
            procs.prune()
        else:
            procs.stop(timeout_s=5)
        until(lambda: not alive(helper), f"the dead child's helper {helper} still runs", 5)
    finally:
        procs.stop(timeout_s=5)
