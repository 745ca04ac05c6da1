"""What counting tokens through Envoy costs: CPU per request of the picker's process and of Envoy for 1-token and
256-token streamed completions, from a key without a token limit (the Lua filter only looks up its flags) and from
a key with one (the Lua filter searches every chunk for the usage object and hides the usage-only chunk); then the
picker's CPU per access log entry alone (decode + settle), measured in this process.

    python -m bench.envoy_usage_cost                   # 3 rounds of 48 requests per arm at 8 clients
    python -m bench.envoy_usage_cost --rounds 1        # quicker

One tiny-model engine; one gateway (--data-plane envoy, scraping every 2 s so a long stream does not look dear
because it took longer) whose idle CPU is measured first and subtracted (bench/picker_cpu.py's method).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2

from bench.fleet_procs import MODEL_NAME, BenchFleet
from bench.picker_cpu import Cpu, closed_loop, idle_rate
from kvfleet.gateway.engines.pool import EndpointPool
from kvfleet.gateway.envoy.bootstrap import ENGINES_CLUSTER
from kvfleet.gateway.envoy.feed import EnvoyFeed
from kvfleet.gateway.envoy.lua import USAGE_NAMESPACE
from kvfleet.gateway.limits.usage import Settlement
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.token_estimate import Cost

PLAIN_KEY, TPM_KEY = "sk-bench-plain-" + "p" * 16, "sk-bench-tpm-" + "t" * 16


async def _one(client: httpx.AsyncClient, url: str, key: str, i: int, max_tokens: int) -> int:
    """One streamed completion (usage not asked for); the number of chunks with text, -1 on a failure."""
    body = {"model": MODEL_NAME, "prompt": f"request {i}: the quick brown fox", "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    chunks = 0
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"authorization": f"Bearer {key}"}) as response:
        if response.status_code != 200:
            return -1
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if '"usage"' in line:
                    return -2  # a usage chunk the client did not ask for
    return chunks


def measure(url: str, pid: int, idle: Cpu, key: str, n: int, concurrency: int, max_tokens: int) -> dict:
    before = Cpu.of(pid)
    wall, results = asyncio.run(closed_loop(n, concurrency, lambda c, i: _one(c, url, key, i, max_tokens), 300.0))
    used = Cpu.of(pid) - before
    return {"max_tokens": max_tokens, "tpm_key": key == TPM_KEY, "requests": n, "failed": sum(r < 0 for r in results),
            "req_per_s": round(n / wall, 1),
            "picker_ms": round((used.picker - idle.picker * wall) * 1000 / n, 3),
            "envoy_ms": round((used.envoy - idle.envoy * wall) * 1000 / n, 3),
            "envoy_us_per_token": round((used.envoy - idle.envoy * wall) * 1e6 / n / max_tokens, 2)}


def entry_cost(entries: int = 20_000) -> dict:
    """The picker's CPU per access log entry: one request's downstream entry (ticket, usage) and its attempt's
    upstream entry, decoded from the wire format and recorded (settled, counted, judged)."""
    pool = EndpointPool()
    pool.set_urls(["http://127.0.0.1:8001"])
    feed = EnvoyFeed(pool, GatewayMetrics())
    message = als_pb2.StreamAccessLogsMessage()
    for i in range(entries // 2):
        ticket = f"{feed._prefix}-{i + 1}"
        down = message.http_logs.log_entry.add()
        down.common_properties.access_log_type = accesslog_pb2.DownstreamEnd
        down.common_properties.metadata.filter_metadata[USAGE_NAMESPACE].update(
            {"ticket": ticket, "count_usage": True, "total_tokens": 263, "prompt_tokens": 7,
             "completion_tokens": 256})
        down.response.response_code.value = 200
        down.request.request_id = f"{i:032x}"
        up = message.http_logs.log_entry.add()
        up.common_properties.access_log_type = accesslog_pb2.UpstreamEnd
        up.common_properties.upstream_cluster = ENGINES_CLUSTER
        up.common_properties.upstream_remote_address.socket_address.address = "127.0.0.1"
        up.common_properties.upstream_remote_address.socket_address.port_value = 8001
        up.response.response_code.value = 200
    wire = message.SerializeToString()
    settled: list[int] = []

    async def run() -> float:
        for _ in range(entries // 2):
            feed.expect("standard", Settlement(Cost(7, 300), settled.append))
        started = time.process_time()
        for entry in als_pb2.StreamAccessLogsMessage.FromString(wire).http_logs.log_entry:
            feed.record(entry)
        return time.process_time() - started

    seconds = asyncio.run(run())
    assert len(settled) == entries // 2 and not feed.expected
    return {"entries": entries, "bytes_per_entry": round(len(wire) / entries, 1),
            "us_per_entry": round(seconds * 1e6 / entries, 2), "us_per_request": round(seconds * 2e6 / entries, 2)}


def medians(arms: list[dict]) -> dict:
    """Per arm (tokens, key kind): the median picker and Envoy CPU ms per request over the rounds."""
    out: dict = {}
    for arm in arms:
        out.setdefault(f"{arm['max_tokens']} tokens, {'tpm key' if arm['tpm_key'] else 'no tpm'}", []).append(arm)
    return {name: {what: round(statistics.median(a[what] for a in runs), 3) for what in ("picker_ms", "envoy_ms")}
            for name, runs in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48, help="requests in each arm")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    rows: dict = {"entry": entry_cost()}
    print(json.dumps(rows["entry"]), flush=True)
    keys = Path(tempfile.mkdtemp()) / "keys.txt"
    keys.write_text(f"{PLAIN_KEY} name=plain\n{TPM_KEY} name=tpm tpm=1000000000\n")
    with BenchFleet(max_num_seqs=[8], max_model_len=512) as fleet:
        url = fleet.start_gateway(extra=["--data-plane", "envoy", "--saturation-queue", "1000000",
                                         "--scrape-interval-ms", "2000", "--api-keys-file", str(keys)])
        pid = fleet.gateways[0].pid
        asyncio.run(closed_loop(16, args.concurrency, lambda c, i: _one(c, url, TPM_KEY, i, 1)))  # warm-up
        idle = idle_rate(pid, 10.0)
        rows["idle_ms_per_s"] = {"picker": round(idle.picker * 1000, 2), "envoy": round(idle.envoy * 1000, 2)}
        rows["arms"] = []
        for _ in range(args.rounds):  # interleaved, so drift on a shared machine hits every arm alike
            for max_tokens in (1, args.tokens):
                for key in (PLAIN_KEY, TPM_KEY):
                    rows["arms"].append(measure(url, pid, idle, key, args.requests, args.concurrency, max_tokens))
                    print(json.dumps(rows["arms"][-1]), flush=True)
        rows["median"] = medians(rows["arms"])
        print(json.dumps(rows["median"], indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
