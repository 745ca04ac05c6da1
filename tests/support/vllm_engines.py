"""Real vLLM engines for the tests, run as kvfleet runs them (`kvfleet up --runtime vllm`: the managed install, one
core each, loopback KV events, the fleet's token). vLLM takes 40 s to a few minutes to start on these machines, so the
suite starts one such fleet once (the session fixture `vllm_fleet` in conftest.py) and every test that needs it shares
it; a test that must stop or restart an engine starts its own. Tests leave the engines as they found them: idle.

Without a vLLM install the tests that need one skip, saying how to install it, except where $KVFLEET_REQUIRE_VLLM is
set (scripts/test.sh, so CI): there a missing vLLM fails the suite.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from kvfleet.fleet.ports import free_port
from kvfleet.local.fleet import FleetSpec, LocalFleet
from kvfleet.local.vllm import VllmInstall, VllmNotInstalled, find_vllm

REQUIRE_ENV = "KVFLEET_REQUIRE_VLLM"
SERVED = "smollm2-135m-instruct"
MAX_NUM_SEQS = 4  # five requests at once fill one engine: its waiting list is then non-empty
BLOCK_SIZE = 128  # vLLM's on CPUs
# Eager (-O0): the same scheduler, cache, events and API as the compiled default, ready in ~40 s instead of ~100-150 s
# (torch.compile's warm-up); the benchmarks run vLLM compiled.
ENGINE_ARGS = ("-O0",)
START_TIMEOUT_S = 400.0  # two starting together on two cores, on a slow machine
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([-+0-9.eE]+|NaN|[+-]Inf)$")


def require_vllm() -> VllmInstall:
    try:
        return find_vllm()
    except VllmNotInstalled as err:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"${REQUIRE_ENV} is set and {err}")
        pytest.skip(str(err))


def metric(url: str, name: str, headers: dict | None = None, **labels: str) -> float:
    """The sum of the samples of `name` at url/metrics whose labels include `labels`."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    total = 0.0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match[1] == name and all(f'{key}="{value}"' in (match[2] or "") for key, value in labels.items()):
            total += float(match[3])
    return total


@dataclass
class VllmFleet:
    """`kvfleet up --runtime vllm`: two vLLM engines, one core each, behind a gateway with Redis, watched as
    `kvfleet up` watches them (an engine that exits is started again) until stop()."""

    fleet: LocalFleet
    stopping: threading.Event = field(default_factory=threading.Event)
    watcher: threading.Thread | None = None

    def watch(self) -> None:
        self.watcher = threading.Thread(target=self.fleet.watch, args=(self.stopping.is_set,), daemon=True)
        self.watcher.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.watcher is not None:
            self.watcher.join(timeout=10)
        self.fleet.stop()

    @property
    def url(self) -> str:
        return self.fleet.url

    @property
    def engines(self) -> list[str]:
        return [e.url for e in self.fleet.engines]

    @property
    def token(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.fleet.engine_api_key}"}

    @property
    def redis_url(self) -> str:
        return self.fleet.redis.url

    def engine_metric(self, k: int, name: str) -> float:
        return metric(self.engines[k], name, self.token)

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Until no engine runs or holds a request (a test's leftovers must not reach the next)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self.engine_metric(k, "vllm:num_requests_running") + self.engine_metric(
                    k, "vllm:num_requests_waiting") == 0 for k in range(len(self.engines))):
                return
            time.sleep(0.2)
        raise AssertionError(f"the vLLM engines were still busy after {timeout_s:.0f} s")


def start_vllm_fleet(install: VllmInstall) -> VllmFleet:
    spec = FleetSpec(engines=2, runtime="vllm", vllm=str(install.executable), port=free_port(),
                     max_num_seqs=MAX_NUM_SEQS, max_model_len=2048, kv_cache_memory="1GiB",
                     engine_args=list(ENGINE_ARGS), ready_timeout_s=START_TIMEOUT_S)
    fleet = LocalFleet(spec)
    try:
        fleet.start()
    except BaseException:
        fleet.stop()
        raise
    started = VllmFleet(fleet)
    started.watch()
    return started
