"""Chaos: engines killed under load, and what the clients got (issue 57's targets).

    python -m bench.chaos                                   # kvfleet engines: all four arms
    python -m bench.chaos --runtime vllm --arms envoy       # vLLM engines (kvfleet vllm install)
    python -m bench.chaos --quick                           # a ~2-minute smoke run

Three engines (float32, greedy: every answer has one right text) behind a gateway; `--concurrency` clients each send
one request after another, streamed and not in turn, over `--prompts` prompts whose undisturbed answers were taken
first through the same gateway. Every `--kill-every` seconds for `--duration` seconds the next engine in turn is
SIGKILLed and started again at once on its port (as a pod's container restarts). Arms, one after another on the same
engines: `python` (the Python data plane, migration on: the default there), `python-no-migration`
(--migration-limit 0: the baseline), `envoy` (the default data plane, migrating through the gateway's app:
gateway/envoy/handoff.py) and `envoy-no-migration` (Envoy carrying every answer straight from its engine).

Reports per arm: requests answered whole (200, the model's own end, [DONE] for a stream, no error event), text
identical to the undisturbed answer, and for the streams that were in flight on a killed engine the longest gap
between two chunks the client saw; the gateway's kvfleet_gateway_migrations_total. Targets (issue 57): 100 % whole,
>= 99 % identical, a migrated stream's longest gap <= 2 s on kvfleet engines.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.fleet_procs import MODEL_NAME, BenchFleet, wait_for
from kvfleet.local.supervisor import Child, spawn

ARMS = {"python": ["--data-plane", "python"],
        "python-no-migration": ["--data-plane", "python", "--migration-limit", "0"],
        "envoy": ["--data-plane", "envoy"],
        "envoy-no-migration": ["--data-plane", "envoy", "--migration-limit", "0"]}
TOPICS = ("the sea", "a lighthouse", "winter", "a library", "trains", "bees", "the moon", "a market", "rain",
          "mountains", "a clock", "bread", "a river", "owls", "a garden", "the desert")


@dataclass
class Outcome:
    prompt: int
    stream: bool
    engine: str | None
    started: float
    ended: float
    whole: bool
    text: str
    why: str = ""  # what was wrong, when not whole
    max_gap_s: float = 0.0


@dataclass
class Kills:
    """When each engine was killed: (monotonic time, engine URL)."""

    at: list[tuple[float, str]] = field(default_factory=list)

    def hit(self, outcome: Outcome) -> bool:
        return any(outcome.started < t < outcome.ended and url == outcome.engine for t, url in self.at)


def prompt_of(i: int) -> str:
    return f"Write a short poem about {TOPICS[i % len(TOPICS)]}, number {i}."


def ask(url: str, i: int, stream: bool, max_tokens: int) -> Outcome:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt_of(i)}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    started = time.monotonic()
    try:
        if not stream:
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
            engine = r.headers.get("x-kvfleet-engine")
            if r.status_code != 200:
                return Outcome(i, stream, engine, started, time.monotonic(), False, "", f"status {r.status_code}")
            choice = r.json()["choices"][0]
            whole = choice["finish_reason"] in ("stop", "length")
            return Outcome(i, stream, engine, started, time.monotonic(), whole, choice["message"]["content"] or "",
                           "" if whole else f"finish_reason {choice['finish_reason']}")
        text, finish, done, error, gap, last = "", None, False, "", 0.0, time.monotonic()
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
            engine = r.headers.get("x-kvfleet-engine")
            if r.status_code != 200:
                r.read()
                return Outcome(i, stream, engine, started, time.monotonic(), False, "", f"status {r.status_code}")
            for line in r.iter_lines():
                now = time.monotonic()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    gap, last = max(gap, now - last), now
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"].get("code") or "error"
                        continue
                    for choice in chunk.get("choices") or []:
                        text += (choice.get("delta") or {}).get("content") or ""
                        finish = choice.get("finish_reason") or finish
        whole = done and not error and finish in ("stop", "length")
        why = "" if whole else error or (f"finish_reason {finish}" if done else "no [DONE]")
        return Outcome(i, stream, engine, started, time.monotonic(), whole, text, why, gap)
    except httpx.HTTPError as err:
        return Outcome(i, stream, None, started, time.monotonic(), False, "", type(err).__name__)


def killer(fleet: BenchFleet, kills: Kills, every_s: float, stop: threading.Event) -> None:
    """Every `every_s`: SIGKILL the next engine (its whole process tree) and start it again on its port."""
    for k in itertools.count():
        if stop.wait(every_s):
            return
        i = k % len(fleet.engines)
        victim = fleet.engines[i]
        env = dict(e.split("=", 1) for e in Path(f"/proc/{victim.pid}/environ").read_text().split("\0") if "=" in e)
        os.killpg(victim.pid, signal.SIGKILL)
        kills.at.append((time.monotonic(), victim.url))
        victim.wait()
        fleet.engines[i] = restart(victim, env, fleet.log_dir)


def restart(old: Child, env: dict[str, str], log_dir: Path) -> Child:
    new = spawn(old.name, list(old.proc.args), url=old.url, log_dir=log_dir, env=env)
    threading.Thread(target=wait_for, args=(new, "/health", 600.0), daemon=True).start()
    return new


def run_arm(fleet: BenchFleet, arm: str, args: argparse.Namespace, reference: dict[int, str] | None):
    url = fleet.start_gateway(extra=[*ARMS[arm], "--upstream-idle-timeout", "3"])
    if reference is None:  # the undisturbed answers, through the first arm's gateway before any kill
        reference = {i: ask(url, i, False, args.max_tokens).text for i in range(args.prompts)}
    counter, outcomes, kills, stop = itertools.count(), [], Kills(), threading.Event()

    def client() -> None:
        while not stop.is_set():
            n = next(counter)
            outcomes.append(ask(url, n % args.prompts, n % 2 == 0, args.max_tokens))

    threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
    chaos = threading.Thread(target=killer, args=(fleet, kills, args.kill_every, stop))
    for t in [*threads, chaos]:
        t.start()
    time.sleep(args.duration)
    stop.set()
    for t in [*threads, chaos]:
        t.join()
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    migrations = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
                  if line.startswith("kvfleet_gateway_migrations_total{")}
    for engine in fleet.engines:  # every engine back before the next arm
        wait_for(engine, "/health", 600.0)
    return reference, summarize(arm, outcomes, reference, kills, migrations)


def summarize(arm: str, outcomes: list[Outcome], reference: dict[int, str], kills: Kills,
              migrations: dict[str, float]) -> dict:
    whole = [o for o in outcomes if o.whole]
    same = [o for o in whole if o.text == reference[o.prompt]]
    hit_streams = [o for o in outcomes if o.stream and kills.hit(o)]
    hit = [o for o in outcomes if kills.hit(o)]
    whys: dict[str, int] = {}
    for o in outcomes:
        if not o.whole:
            whys[o.why] = whys.get(o.why, 0) + 1
    gaps = sorted(o.max_gap_s for o in hit_streams if o.whole)
    return {"arm": arm, "requests": len(outcomes), "whole": len(whole), "identical": len(same), "kills": len(kills.at),
            "in_flight_on_a_killed_engine": len(hit), "hit_whole": sum(o.whole for o in hit),
            "hit_identical": sum(o.whole and o.text == reference[o.prompt] for o in hit),
            "not_whole": whys, "hit_stream_max_gap_s": {"p50": gaps[len(gaps) // 2] if gaps else None,
                                                         "max": gaps[-1] if gaps else None, "n": len(gaps)},
            "different": [(o.prompt, o.stream, o.text[:80], reference[o.prompt][:80])
                          for o in whole if o.text != reference[o.prompt]][:5],
            "migrations": migrations}


def report(results: list[dict]) -> str:
    lines = ["arm                  requests  whole     identical  kills  hit  hit whole  hit identical  "
             "hit stream gap p50 / max"]
    for r in results:
        g = r["hit_stream_max_gap_s"]
        gap = f"{g['p50']:.2f} / {g['max']:.2f} s ({g['n']})" if g["n"] else "-"
        lines.append(f"{r['arm']:<20} {r['requests']:>8}  {100 * r['whole'] / max(1, r['requests']):6.2f} %  "
                     f"{100 * r['identical'] / max(1, r['requests']):6.2f} %  {r['kills']:>5}  "
                     f"{r['in_flight_on_a_killed_engine']:>3}  {r['hit_whole']:>9}  {r['hit_identical']:>13}  {gap}")
    for r in results:
        if r["not_whole"]:
            lines.append(f"{r['arm']}: not whole: {r['not_whole']}")
        if r["migrations"]:
            lines.append(f"{r['arm']}: {r['migrations']}")
        for diff in r["different"]:
            lines.append(f"{r['arm']}: whole but different: {diff}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runtime", choices=("kvfleet", "vllm"), default="kvfleet")
    p.add_argument("--model", help="default: 'tiny' on kvfleet engines; smollm2-135m-instruct on vLLM, whose CPU "
                                   "attention has no kernel for the tiny model's 16-wide heads")
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--arms", type=lambda s: [a for a in s.split(",") if a], default=list(ARMS))
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load per arm")
    p.add_argument("--kill-every", type=float, default=20.0)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="40 s per arm, a kill every 10 s")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    if args.quick:
        args.duration, args.kill_every = 40.0, 10.0
    if args.model is None:
        args.model = "smollm2-135m-instruct" if args.runtime == "vllm" else "tiny"
    unknown = set(args.arms) - set(ARMS)
    if unknown:
        p.error(f"unknown arms {sorted(unknown)}: choose from {', '.join(ARMS)}")
    dtype = ["--dtype", "float32"]
    with BenchFleet(model=args.model, max_num_seqs=[8] * args.engines, runtime=args.runtime, max_model_len=1024,
                    engine_args=dtype, use_redis=False) as fleet:
        reference, results = None, []
        for arm in args.arms:
            reference, result = run_arm(fleet, arm, args, reference)
            results.append(result)
            print(report([result]), flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    print(f"\n{args.runtime} engines ({args.model}, float32) x {args.engines} on {cpu}, {os.cpu_count()} cores; "
          f"{args.duration:.0f} s per arm, a kill every {args.kill_every:.0f} s, {args.concurrency} clients")
    print(report(results))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"chaos-{args.runtime}.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                                    "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
