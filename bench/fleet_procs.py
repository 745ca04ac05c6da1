"""Processes for the gateway benchmarks: an embedded Redis, engines that may differ in --max-num-seqs (kvfleet's, or
real vLLM engines from kvfleet's managed install), and gateways that can be restarted with another routing strategy
in front of the same engines."""

from __future__ import annotations

import gc
import json
import os
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet.fleet.engine_settings import BENCH, EngineSettings
from kvfleet.fleet.load import parse_engine_load
from kvfleet.fleet.ports import free_port
from kvfleet.fleet.vllm_serve import HEALTH_PATH, serve_args
from kvfleet.local.redis_server import RedisServer
from kvfleet.local.supervisor import Child, kvfleet_command, stop_together
from kvfleet.local.supervisor import spawn as spawn_child

MODEL_NAME = "bench-model"  # what the engines serve and the clients ask for
FALLBACK_NAME = "bench-fallback"  # what a fallback engine serves (the degradation ladder's second rung)


def model_dir(model: str) -> Path:
    """'tiny' (a random 3-layer Llama, ~5 ms/token on one core, built once into the kvfleet cache) or any
    name or directory that `kvfleet engine --model` takes."""
    from kvfleet.engine.model_files import default_cache_dir, resolve_model

    if model != "tiny":
        return resolve_model(model)
    out = default_cache_dir() / "bench-tiny-llama"
    if not (out / "config.json").exists():
        from tests.support.tiny_model import build_tiny_llama

        build_tiny_llama(out, resolve_model("smollm2-135m-instruct"))
    return out


def latency_stats(values: list[float]) -> dict[str, float]:
    """Mean and nearest-rank p50/p90/p99 of latencies (seconds); {} for none."""
    ordered = sorted(values)
    if not ordered:
        return {}

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    return {"mean": sum(ordered) / len(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def spawn(name: str, args: list[str], url: str, log_dir: Path) -> Child:
    """`python -m kvfleet.cli <args>`, one thread for torch, output into <log_dir>/<name>.log."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return spawn_child(name, kvfleet_command(*args), url=url, log_dir=log_dir, env=env)


def get(url: str, timeout: float = 2.0) -> str | None:
    """The body of a 200 answer, else None."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode() if response.status == 200 else None
    except OSError:
        return None


def wait_for(proc: Child, path: str, timeout_s: float = 300.0,
             check: Callable[[str], bool] = lambda body: True) -> None:
    """Until GET <proc.url><path> answers 200 with a body that passes `check`; the log's end if it dies."""
    def answered() -> bool:
        body = get(proc.url + path)
        return body is not None and check(body)

    proc.wait_ready(answered, timeout_s, poll_s=0.2)


@dataclass
class BenchFleet:
    """Redis + one engine per entry of `max_num_seqs` + gateways in front of them all. A context manager."""

    model: str = "tiny"
    max_num_seqs: list[int] = field(default_factory=lambda: [BENCH.max_num_seqs])
    max_model_len: int = 512
    kv_cache_memory: str = "32MiB"
    use_redis: bool = True
    engine_args: list[str] = field(default_factory=list)  # more `kvfleet engine` (or `vllm serve`) flags for each
    runtime: str = "kvfleet"  # or "vllm": `vllm serve` engines, one core each, dev mode (/reset_prefix_cache)
    engine_nice: int = 0  # the engines' niceness: >0 lets the routers (any arm's) take a core when they need one
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvfleet-bench-")))
    engines: list[Child] = field(default_factory=list)
    fallback_engines: list[Child] = field(default_factory=list)  # another model's, FALLBACK_NAME (start_fallback)
    gateways: list[Child] = field(default_factory=list)
    redis: RedisServer | None = None

    def __enter__(self) -> BenchFleet:
        try:
            self.start_engines()
        except BaseException:
            self.close()
            raise
        # Resolving the model imported torch: hundreds of thousands of objects that every full collection in this
        # process (the load generator) would scan, stalling its event loop for up to a second under load.
        gc.collect()
        gc.freeze()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start_engines(self) -> None:
        path = model_dir(self.model)
        if self.use_redis:
            self.redis = RedisServer().start()
        if self.runtime == "vllm":
            self._start_vllm_engines(path)
            return
        for i, seqs in enumerate(self.max_num_seqs):
            port = free_port()
            settings = EngineSettings(model=str(path), max_model_len=self.max_model_len,
                                      kv_cache_memory=self.kv_cache_memory, max_num_seqs=seqs)
            args = ["engine", *settings.to_args(), "--served-model-name", MODEL_NAME, "--host", "127.0.0.1",
                    "--port", str(port), *self.engine_args]
            self.engines.append(spawn(f"engine-{i}-seqs{seqs}", args, f"http://127.0.0.1:{port}", self.log_dir))
        for engine in self.engines:
            wait_for(engine, "/ready")

    def _start_vllm_engines(self, path: Path) -> None:
        """vLLM engines as `kvfleet up --runtime vllm` runs them (its managed install, one core each, KV events on
        loopback, 1 GiB of KV space that --num-gpu-blocks-override in engine_args may cap), in dev mode so that a
        benchmark can empty their prefix caches between arms (reset_prefix_caches)."""
        from kvfleet.local.vllm import core_groups, engine_env, find_vllm

        install = find_vllm()
        cores = core_groups(len(self.max_num_seqs))
        base = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
        for i, seqs in enumerate(self.max_num_seqs):
            port = free_port()
            argv = [*(["nice", "-n", str(self.engine_nice)] if self.engine_nice else []),
                    str(install.executable), "serve", *serve_args(
                str(path), MODEL_NAME, port, host="127.0.0.1", events_port=0, max_model_len=self.max_model_len,
                max_num_seqs=seqs, extra=self.engine_args)]
            self.engines.append(spawn_child(f"vllm-{i}-seqs{seqs}", argv, url=f"http://127.0.0.1:{port}",
                                            log_dir=self.log_dir, env=engine_env(install, base, cores=cores[i],
                                                                       kv_cache_memory="1GiB")))
        for engine in self.engines:
            wait_for(engine, HEALTH_PATH, timeout_s=600.0)

    def reset_prefix_caches(self) -> None:
        """Empty every vLLM engine's prefix cache (its dev-mode endpoint); the engines must be idle."""
        for engine in self.engines:
            request = urllib.request.Request(engine.url + "/reset_prefix_cache", method="POST")
            with urllib.request.urlopen(request, timeout=30) as response:
                if response.status != 200:
                    raise RuntimeError(f"{engine.name}: /reset_prefix_cache answered {response.status}")

    def start_fallback(self, model: str, max_num_seqs: int) -> None:
        """One engine of another model, served as FALLBACK_NAME: idle until a gateway names it (with_fallback)."""
        port = free_port()
        settings = EngineSettings(model=str(model_dir(model)), max_model_len=self.max_model_len,
                                  kv_cache_memory=self.kv_cache_memory, max_num_seqs=max_num_seqs)
        args = ["engine", *settings.to_args(), "--served-model-name", FALLBACK_NAME, "--host", "127.0.0.1",
                "--port", str(port), *self.engine_args]
        self.fallback_engines.append(spawn(f"fallback-seqs{max_num_seqs}", args, f"http://127.0.0.1:{port}",
                                           self.log_dir))
        wait_for(self.fallback_engines[-1], "/ready")

    def start_gateway(self, routing: str = "kvfleet", fleet: str = "bench", extra: list[str] = (),
                      alongside: bool = False, with_fallback: bool = False) -> str:
        """A fresh gateway (the others stopped unless `alongside`); its URL once it has scraped every engine.
        `with_fallback`: two models, MODEL_NAME on the engines and FALLBACK_NAME on the fallback engines, which
        MODEL_NAME's requests may fall back to (--fallback); the fleets are then named by the models."""
        if not alongside:
            self.stop_gateway()
        port = free_port()
        if with_fallback:
            engines = [*(f"{MODEL_NAME}={e.url}" for e in self.engines),
                       *(f"{FALLBACK_NAME}={e.url}" for e in self.fallback_engines)]
            routes = ["--fallback", f"{MODEL_NAME}={FALLBACK_NAME}"]
        else:
            engines, routes = [e.url for e in self.engines], ["--fleet", fleet]
        args = ["gateway", "--host", "127.0.0.1", "--port", str(port), *routes, "--routing", routing,
                *(f for e in engines for f in ("--engine", e)), *extra]
        if self.redis is not None:
            args += ["--redis-url", self.redis.url]
        gateway = spawn(f"gateway-{fleet}", args, f"http://127.0.0.1:{port}", self.log_dir)
        self.gateways.append(gateway)
        wait_for(gateway, "/ready", check=lambda body: json.loads(body)["available"] == len(engines))
        return gateway.url

    def stop_gateway(self) -> None:
        stop_together(self.gateways)
        self.gateways = []

    def wait_idle(self, settle_s: float = 1.0, timeout_s: float = 120.0) -> None:
        """Until no engine runs or queues anything, then `settle_s` more (so one run's tail never hits the next)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            loads = [parse_engine_load(get(e.url + "/metrics") or "") for e in self.engines + self.fallback_engines]
            if all(load.num_running == 0 and load.num_waiting == 0 for load in loads):
                time.sleep(settle_s)
                return
            time.sleep(0.2)
        raise RuntimeError(f"engines still busy after {timeout_s:.0f} s")

    def cpu_snapshot(self) -> dict[str, float]:
        """CPU seconds used so far by each process: engines, gateways, Redis and this one (the client)."""
        procs = {p.name: p.pid for p in [*self.engines, *self.fallback_engines, *self.gateways]}
        if self.redis is not None and self.redis.proc is not None:
            procs["redis"] = self.redis.proc.pid
        return {**{name: cpu_seconds(pid) for name, pid in procs.items()}, "client": time.process_time()}

    def close(self) -> None:
        self.stop_gateway()
        stop_together(self.engines + self.fallback_engines)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def own_cpu_seconds(pid: int) -> float:
    """User + system CPU time of the process alone, not its children, so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its live descendants so far (Linux /proc): a gateway's Envoy counts
    as the gateway's."""
    return own_cpu_seconds(pid) + sum(cpu_seconds(child) for child in children(pid))


def children(pid: int) -> list[int]:
    """The process's live children (Linux /proc)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each process used between two snapshots."""
    return {name: after[name] - before[name] for name in after if name in before}


def gateway_queue_waits(gateway_url: str) -> dict[str, dict]:
    """From the gateway's /metrics, per class: how many requests have waited in its fleet queue, for how long."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(get(gateway_url + "/metrics") or ""):
        for sample in family.samples:
            if sample.name in ("kvfleet_gateway_queue_wait_seconds_sum", "kvfleet_gateway_queue_wait_seconds_count"):
                key = "queued" if sample.name.endswith("count") else "wait_s"
                out.setdefault(sample.labels["priority"], {"queued": 0, "wait_s": 0.0})[key] = sample.value
    return out


def queue_waits_between(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """Per class, the requests that waited in the gateway's queue between two `gateway_queue_waits` readings."""
    out = {}
    for priority, now in after.items():
        then = before.get(priority, {"queued": 0, "wait_s": 0.0})
        queued, wait_s = int(now["queued"] - then["queued"]), now["wait_s"] - then["wait_s"]
        out[priority] = {"queued": queued, "mean_wait_s": wait_s / queued if queued else None}
    return out
