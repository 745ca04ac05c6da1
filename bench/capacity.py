"""A fleet's capacity for one request shape: every engine kept exactly full (closed loop, as many clients as
its --max-num-seqs), all at once so they share the CPU as they will under load; completions per second."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx

from kvfleet.loadgen import LoadSpec, RequestRecord, plan_requests, send_one


async def _keep_full(client: httpx.AsyncClient, spec: LoadSpec, clients: int, model: str, until: float,
                     run_start: float) -> list[RequestRecord]:
    plan = iter(plan_requests(spec))
    records: list[RequestRecord] = []

    async def worker() -> None:
        while time.perf_counter() < until:
            records.append(await send_one(client, spec, model, next(plan), run_start))

    await asyncio.gather(*(worker() for _ in range(clients)))
    return records


async def saturated_throughput(engines: dict[str, int], shape: LoadSpec, model: str, seconds: float,
                               warmup_s: float = 2.0) -> dict:
    """Requests/s the engines complete together when each is kept full; `engines` maps URL → max_num_seqs.
    Only completions after `warmup_s` count, so start-up does not dilute the rate."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(shape.timeout), limits=limits) as client:
        run_start = time.perf_counter()
        until = run_start + warmup_s + seconds
        per_engine = await asyncio.gather(*(
            _keep_full(client, dataclasses.replace(shape, url=url, num_requests=100_000, seed=shape.seed + i),
                       seqs, model, until, run_start)
            for i, (url, seqs) in enumerate(engines.items())))
    by_engine = {}
    for url, records in zip(engines, per_engine, strict=True):
        done = [r for r in records if r.ok and warmup_s <= r.sent_at + r.e2e_s <= warmup_s + seconds]
        failed = [r for r in records if not r.ok]
        if failed:
            raise RuntimeError(f"calibration request to {url} failed: {failed[0].status} {failed[0].error}")
        by_engine[url] = len(done) / seconds
    return {"requests_per_s": sum(by_engine.values()), "by_engine": by_engine, "seconds": seconds}
