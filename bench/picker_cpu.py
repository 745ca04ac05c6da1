"""The endpoint picker's CPU per request: what `kvfleet gateway --data-plane envoy` burns in its own process (the
picker, Python) and in its Envoy child, per request, for 1-token completions and for 256-token streamed ones.

    python -m bench.picker_cpu                     # 2000 1-token requests at 32 clients, then the stream check
    python -m bench.picker_cpu --requests 500      # quicker
    python -m bench.picker_cpu --requests 1000 --stream-requests 0   # the 1-token run only

One tiny-model engine; one gateway that never counts the engine as saturated (--saturation-queue 1000000), so no
request waits in the fleet queue and what is measured is the per-request path. The gateway's idle CPU (scrapes,
the release ticker) is measured over a quiet window first and subtracted; the stream check runs on a second gateway
that scrapes every 10 s, so a long stream does not look dear because it took longer. The picker should cost the
same for a 256-token stream as for a 1-token answer: Envoy carries the tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.fleet_procs import (
    MODEL_NAME,
    BenchFleet,
    children,
    gateway_queue_waits,
    own_cpu_seconds,
    queue_waits_between,
)

NO_LIMIT = ["--saturation-queue", "1000000"]


@dataclass(frozen=True)
class Cpu:
    """CPU seconds so far of the gateway's own process and of its children (Envoy)."""

    picker: float
    envoy: float

    @staticmethod
    def of(pid: int) -> Cpu:
        return Cpu(own_cpu_seconds(pid), sum(own_cpu_seconds(c) for c in children(pid)))

    def __sub__(self, other: Cpu) -> Cpu:
        return Cpu(self.picker - other.picker, self.envoy - other.envoy)


async def _one(client: httpx.AsyncClient, url: str, i: int, max_tokens: int, stream: bool) -> int:
    """One completion; the number of tokens (stream chunks with text) that came back, -1 on a failure."""
    body = {"model": MODEL_NAME, "prompt": f"request {i}: the quick brown fox jumps over the lazy dog",
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if not stream:
        response = await client.post(url + "/v1/completions", json=body)
        return response.json()["usage"]["completion_tokens"] if response.status_code == 200 else -1
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return -1
        async for line in response.aiter_lines():
            if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                tokens = usage["completion_tokens"]
    return tokens


async def closed_loop(n: int, concurrency: int, send: Callable[[httpx.AsyncClient, int], Awaitable[int]],
                      timeout: float = 120.0) -> tuple[float, list[int]]:
    """n requests from `concurrency` closed-loop clients, `send(client, i)` each; wall seconds and each result."""
    results: list[int] = []
    cursor = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def worker() -> None:
            nonlocal cursor
            while cursor < n:
                i, cursor = cursor, cursor + 1
                results.append(await send(client, i))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started, results


def thread_cpu(pids: list[int]) -> dict[str, float]:
    """CPU seconds so far of the processes' threads, summed by thread name (Linux /proc): the picker's event loop
    is `python`, gRPC's C-core poller `event_engine` and friends; Envoy's workers `wrk:worker_N`."""
    out: dict[str, float] = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                name = (task / "comm").read_text().strip()
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended
                continue
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _per_request_ms(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    return {name: round((cpu - before.get(name, 0.0)) * 1000 / n, 3) for name, cpu in after.items()
            if cpu > before.get(name, 0.0)}


def measure(url: str, pid: int, idle: Cpu, n: int, concurrency: int, max_tokens: int, stream: bool) -> dict:
    """CPU ms per request of the picker's process and of Envoy, idle CPU over the same time taken out; and, idle
    not taken out, by thread."""
    waits, before = gateway_queue_waits(url), Cpu.of(pid)
    threads_before, envoy_threads_before = thread_cpu([pid]), thread_cpu(children(pid))
    wall, results = asyncio.run(closed_loop(n, concurrency, lambda c, i: _one(c, url, i, max_tokens, stream)))
    used = Cpu.of(pid) - before
    threads = _per_request_ms(threads_before, thread_cpu([pid]), n)
    envoy_threads = _per_request_ms(envoy_threads_before, thread_cpu(children(pid)), n)
    queued = sum(q["queued"] for q in queue_waits_between(waits, gateway_queue_waits(url)).values())
    failed = sum(r < 0 for r in results)
    short = sum(0 <= r < max_tokens for r in results)
    return {"requests": n, "concurrency": concurrency, "max_tokens": max_tokens, "stream": stream,
            "failed": failed, "short": short, "queued": queued, "req_per_s": round(n / wall, 1),
            "picker_ms": round((used.picker - idle.picker * wall) * 1000 / n, 3),
            "envoy_ms": round((used.envoy - idle.envoy * wall) * 1000 / n, 3),
            "picker_raw_ms": round(used.picker * 1000 / n, 3), "envoy_raw_ms": round(used.envoy * 1000 / n, 3),
            "picker_threads_raw_ms": threads, "envoy_threads_raw_ms": envoy_threads}


def idle_rate(pid: int, seconds: float) -> Cpu:
    """CPU seconds per second the gateway burns with no request (scrapes, release ticker)."""
    before = Cpu.of(pid)
    time.sleep(seconds)
    used = Cpu.of(pid) - before
    return Cpu(used.picker / seconds, used.envoy / seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="1-token completions in the main run")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--stream-requests", type=int, default=48,
                        help="requests in each arm of the stream check (0: no stream check)")
    parser.add_argument("--stream-concurrency", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=256)
    parser.add_argument("--profile-wait", type=float, default=0.0,
                        help="seconds to wait before the main run (attach py-spy to the printed pid)")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    with BenchFleet(max_num_seqs=[8], max_model_len=512) as fleet:
        url = fleet.start_gateway(extra=["--data-plane", "envoy", *NO_LIMIT])
        pid = fleet.gateways[0].pid
        # warm-up: connections, imports, Envoy's pools
        asyncio.run(closed_loop(64, args.concurrency, lambda c, i: _one(c, url, i, 1, False)))
        idle = idle_rate(pid, 5.0)
        print(f"gateway pid {pid}; idle CPU: picker {idle.picker * 1000:.1f} ms/s, Envoy {idle.envoy * 1000:.1f} "
              "ms/s", flush=True)
        if args.profile_wait:
            time.sleep(args.profile_wait)
        rows = {"idle_ms_per_s": {"picker": round(idle.picker * 1000, 2), "envoy": round(idle.envoy * 1000, 2)}}
        rows["one_token"] = measure(url, pid, idle, args.requests, args.concurrency, 1, False)
        print(json.dumps(rows["one_token"]), flush=True)
        if args.stream_requests <= 0:
            _write(args.out, rows)
            return
        # Scrapes every 75 ms cost more CPU over a 256-token stream than the picker's part of it: the stream check
        # runs on a gateway that scrapes every 10 s (and takes such metrics as fresh, so nothing waits in the queue).
        url = fleet.start_gateway(extra=["--data-plane", "envoy", *NO_LIMIT, "--scrape-interval-ms", "10000",
                                         "--max-metrics-age-ms", "60000"])
        pid = fleet.gateways[0].pid
        asyncio.run(closed_loop(16, args.stream_concurrency, lambda c, i: _one(c, url, i, 1, True)))
        idle = idle_rate(pid, 10.0)
        rows["stream_idle_ms_per_s"] = {"picker": round(idle.picker * 1000, 2), "envoy": round(idle.envoy * 1000, 2)}
        n, c = args.stream_requests, args.stream_concurrency
        rows["stream_1"] = measure(url, pid, idle, n, c, 1, True)
        print(json.dumps(rows["stream_1"]), flush=True)
        rows[f"stream_{args.stream_tokens}"] = measure(url, pid, idle, n, c, args.stream_tokens, True)
        print(json.dumps(rows[f"stream_{args.stream_tokens}"]), flush=True)
    _write(args.out, rows)


def _write(out: Path | None, rows: dict) -> None:
    if out:
        out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
