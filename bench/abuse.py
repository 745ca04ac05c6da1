"""Run the hostile-client catalogue against a live fleet, with honest clients (victims) beside every attack.

    python -m bench.abuse --out bench/results          # starts `kvfleet up --engines 2` (SmolLM2) and stops it
    python -m bench.abuse --url http://127.0.0.1:8080 --engine http://127.0.0.1:8001 --pid 1234 --pid 1235

Per input it prints what the attacker got, how long it took, the fleet's resident memory before and after (all its
processes), whether every engine is still healthy behind the gateway, and whether the victims were unharmed: four
greedy requests (two streaming) sent while the attack runs, each answered 200 with a finish_reason, no error event,
and the same text as when they ran alone. Exits 1 if any row fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.abuse_catalogue import CATALOGUE, Attack, Outcome, Target
from bench.fleet_procs import children
from kvfleet.loadgen import SSE_DONE, sse_data

VICTIM_PROMPTS = ["Name three rivers in Europe.", "What is a prime number?", "Describe a cat in one sentence.",
                  "Count from one to five."]
VICTIM_MAX_TOKENS = 24


@dataclass
class Victim:
    status: int | str
    text: str
    finish_reason: str | None
    error: str | None = None


@dataclass
class Row:
    attack: str
    description: str
    statuses: list
    expected: list
    seconds: float
    rss_before_mib: float | None
    rss_after_mib: float | None
    engines_healthy: str
    victims_unharmed: bool
    passed: bool
    note: str
    harmed: list = field(default_factory=list)  # how each harmed victim differed (empty when none was)


def victim(url: str, model: str, prompt: str, stream: bool) -> Victim:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": VICTIM_MAX_TOKENS,
            "temperature": 0, "stream": stream}
    try:
        if not stream:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            if r.status_code != 200:
                return Victim(r.status_code, "", None, r.text[:200])
            choice = r.json()["choices"][0]
            return Victim(200, choice["message"]["content"], choice.get("finish_reason"))
        text, reason, error = [], None, None
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                return Victim(r.status_code, "", None, r.read().decode()[:200])
            for line in r.iter_lines():
                if (data := sse_data(line)) in (None, SSE_DONE):
                    continue
                event = json.loads(data)
                if "error" in event:
                    error = event["error"].get("message", "error")
                    continue
                for choice in event.get("choices", []):
                    text.append(choice.get("delta", {}).get("content") or "")
                    reason = choice.get("finish_reason") or reason
        return Victim(200, "".join(text), reason, error)
    except httpx.HTTPError as err:
        return Victim("error", "", None, type(err).__name__)


def run_victims(url: str, model: str) -> list[Victim]:
    with ThreadPoolExecutor(len(VICTIM_PROMPTS)) as pool:
        futures = [pool.submit(victim, url, model, p, i % 2 == 0) for i, p in enumerate(VICTIM_PROMPTS)]
        return [f.result() for f in futures]


def harms(got: list[Victim], alone: list[Victim]) -> list[str]:
    """What happened to each victim that was not answered as when it ran alone ("" for none): which one, and how."""
    found = []
    for i, (v, a) in enumerate(zip(got, alone, strict=True)):
        kind = "streaming" if i % 2 == 0 else "non-streaming"
        if v.status != 200 or v.error:
            found.append(f"victim {i} ({kind}): {v.status} {v.error or ''}".strip())
        elif not v.finish_reason:
            found.append(f"victim {i} ({kind}): no finish_reason")
        elif v.text != a.text:
            at = len(os.path.commonprefix([v.text, a.text]))
            found.append(f"victim {i} ({kind}): text differs from char {at}: {v.text[at:at + 30]!r} "
                         f"vs alone {a.text[at:at + 30]!r}")
    return found


def fleet_rss_mib(pids: list[int]) -> float | None:
    """Resident memory of these processes together, from /proc (Linux; None elsewhere or without pids)."""
    if not pids:
        return None
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as statm:
                total += int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return None
    return total / 2**20


def engines_healthy(url: str) -> str:
    try:
        body = httpx.get(url + "/ready", timeout=5).json()
        return f"{body.get('healthy')}/{body.get('engines')}"
    except (httpx.HTTPError, ValueError):
        return "gateway down"


# After an attack, before the health check: four of the gateway's scrapes (75 ms apart), so an engine the attack
# crashed is unhealthy by then (an engine that hangs is caught by the victims, whose answers would not come).
SETTLE_S = 0.3


def run_one(attack: Attack, target: Target, pids: list[int], alone: list[Victim]) -> Row:
    before = fleet_rss_mib(pids)
    with ThreadPoolExecutor(1) as pool:
        victims = pool.submit(run_victims, target.gateway_url, target.model)
        time.sleep(0.3)  # the victims are in flight when the attack lands
        try:
            outcome = attack.run(target)
        except Exception as err:  # noqa: BLE001 - a broken attack is a row, not the end of the run
            outcome = Outcome([f"bench error {type(err).__name__}"], 0.0, str(err)[:100])
        got = victims.result()
    if attack.aftermath is not None:
        outcome.note = outcome.note or attack.aftermath(target)
    time.sleep(SETTLE_S)
    health = engines_healthy(target.gateway_url)
    harmed = harms(got, alone)
    ok_victims = not harmed
    expected_health = f"{len(target.engine_urls)}/{len(target.engine_urls)}" if target.engine_urls else health
    passed = attack.passed(outcome) and ok_victims and health == expected_health
    return Row(attack.name, attack.description, outcome.statuses, sorted(map(str, attack.expected)),
               round(outcome.seconds, 3), before, fleet_rss_mib(pids), health, ok_victims, passed, outcome.note,
               harmed)


def table(rows: list[Row]) -> str:
    lines = ["| input | attacker got | expected | time (s) | fleet RSS before → after (MiB) | engines healthy "
             "| victims unharmed | ok |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        statuses = ", ".join(str(s) for s in dict.fromkeys(r.statuses))
        rss = "n/a" if r.rss_before_mib is None else f"{r.rss_before_mib:,.0f} → {r.rss_after_mib:,.0f}"
        note = f" ({r.note})" if r.note else ""
        hurt = f" ({'; '.join(r.harmed)})" if r.harmed else ""
        lines.append(f"| {r.attack}: {r.description} | {statuses}{note} | {' / '.join(r.expected)} | {r.seconds:.2f} "
                     f"| {rss} | {r.engines_healthy} | {'yes' if r.victims_unharmed else 'NO'}{hurt} "
                     f"| {'yes' if r.passed else 'NO'} |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running gateway; without it a local fleet is started")
    p.add_argument("--engine", action="append", default=[], help="an engine URL behind --url (repeatable)")
    p.add_argument("--pid", type=int, action="append", default=[], help="a fleet process to measure (repeatable)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--only", action="append", default=[], help="run only attacks whose name contains this")
    p.add_argument("--out", type=Path, help="write abuse.json and abuse.md here")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    fleet = None
    if args.url:
        target, pids = Target(args.url, args.model, args.engine), args.pid
    else:
        from kvfleet.fleet.ports import free_port
        from kvfleet.local.fleet import FleetSpec, LocalFleet

        fleet = LocalFleet(FleetSpec(engines=args.engines, model=args.model, port=free_port()))
        fleet.start()
        target = Target(fleet.url, args.model, [e.url for e in fleet.engines], fleet.run_dir)
        gateway = fleet.gateway.proc.pid  # with its Envoy child, which holds the attackers' connections
        pids = [gateway, *children(gateway), *(e.proc.pid for e in fleet.engines)]
    try:
        alone = run_victims(target.gateway_url, target.model)
        if run_victims(target.gateway_url, target.model) != alone:
            print("warning: the victims' answers differ between two runs alone; 'unharmed' compares with the first",
                  file=sys.stderr)
        attacks = [a for a in CATALOGUE if not args.only or any(o in a.name for o in args.only)]
        rows = []
        for attack in attacks:
            rows.append(run_one(attack, target, pids, alone))
            print(f"{attack.name}: {'ok' if rows[-1].passed else 'FAILED'}", file=sys.stderr, flush=True)
    finally:
        if fleet is not None:
            fleet.stop()
    print(table(rows))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "abuse.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
        (args.out / "abuse.md").write_text(table(rows) + "\n")
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
