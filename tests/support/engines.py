"""Real engines as a test drives them: their gauges, long streams that hold their slots, and a one-sequence engine held
saturated until the gateways in front count it so."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tests.support.polling import until

LONG = ("--max-model-len", "1024", "--kv-cache-memory", "32MiB")  # a small engine whose requests can run long


def hold_stream(url: str, model: str, stop: threading.Event, max_tokens: int = 700,
                auth: dict[str, str] | None = None) -> None:
    """A long streamed request that the client drops when told to (the engine then aborts it)."""
    body = {"model": model, "prompt": "busy", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth, timeout=120) as r:
        for _ in r.iter_lines():
            if stop.is_set():
                return


def engine_gauge(engine: str, name: str) -> int:
    for line in httpx.get(f"{engine}/metrics", timeout=5).text.splitlines():
        if line.startswith(f"{name} "):
            return int(float(line.split()[1]))
    raise AssertionError(f"no {name} at {engine}")


def running(engine: str) -> int:
    return engine_gauge(engine, "kvfleet_num_requests_running")


def waiting(engine: str) -> int:
    return engine_gauge(engine, "kvfleet_num_requests_waiting")


@contextmanager
def saturated(engine: str, model: str, fronts: tuple[str, ...], holders: int = 4,
              served_as: str | None = None, until_exit: bool = False) -> Iterator[None]:
    """The one-sequence engine kept busy with one request running and the rest waiting (--saturation-queue 1); it
    stays saturated until all but one have run, holders - 1 times the ~2.5 s a 1000-token request takes here (two
    holders left a window short enough for a queued request to be released by the first one's end), or with
    `until_exit` (holders >= 3: one running, one waiting while another sends again) until the block exits, however
    fast the engine. The block runs once every gateway in `fronts` counts the engine saturated (`served_as`: the
    model it is under in a gateway of several), whatever the machine's speed."""
    stop = threading.Event()

    def hold() -> None:
        hold_stream(engine, model, stop, 1000)
        while until_exit and not stop.is_set():
            hold_stream(engine, model, stop, 1000)
    assert not until_exit or holders >= 3, "until_exit needs three holders: one running, two waiting"
    threads = [threading.Thread(target=hold) for _ in range(holders)]
    for t in threads:
        t.start()
    try:
        until(lambda: waiting(engine) == holders - 1, "never saturated")
        until(lambda: all(sees_saturated(front, served_as) for front in fronts),
              "a gateway never saw the engine saturated")
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()


def sees_saturated(gateway: str, served_as: str | None = None) -> bool:
    """The gateway's own view (/ready): it knows a healthy engine and none has room (of model `served_as`)."""
    ready = httpx.get(f"{gateway}/ready", timeout=5).json()
    fleet = ready["models"][served_as] if served_as else ready
    return fleet["healthy"] >= 1 and fleet["available"] == 0
