"""One bursty trace end to end on the local Kubernetes path (issue 17), against the simulator's prediction for it.

`calibrate` measures one engine alone on this machine (through a local cluster of one pod): its prefill tokens/s and
full-batch decode tokens/s as it reports them, its decode rate with one sequence (for the batch curve), and the
chat template's prompt overhead. `run` writes a short bursty trace, starts `kvfleet up --kubernetes`
in-process (KMock's API, the real operator autoscaling every 5 s, engine processes, the real gateway and Redis),
replays the trace through the gateway with streaming chat requests at the trace's times, polls the fleet every
second, then replays the same trace in the simulator (`kvfleet bench autoscale`, engine model from the calibration,
cold start as the slowest pod start seen by the poll, else the operator's status.coldStartSeconds) and writes both
sides side by side. By hand, not in CI:

    python -m bench.autoscale_e2e calibrate --out /tmp/cal.json
    python -m bench.autoscale_e2e run --calibration /tmp/cal.json   # maxReplicas 3: docs/benchmarks/autoscale_e2e.json
    python -m bench.autoscale_e2e run --calibration /tmp/cal.json --max-replicas 2 \
        --json docs/benchmarks/autoscale_e2e_max2.json --trace-copy /tmp/same-trace.csv
    python -m bench.autoscale_e2e predict --json docs/benchmarks/autoscale_e2e.json   # redo the simulator's sides

With --runtime vllm the fleet is `runtime: vllm` (real `vllm serve` pods from the operator's spec, bfloat16, one core
each as the local kubelet pins them). vLLM does not report its capacity, so the calibration measures it from outside
(`kvfleet bench capacity`, kvfleet/capacity_probe.py) and the fleet declares it (spec.autoscaling.capacity), as a
vLLM user would; the probe runs on kvfleet's engine too, beside the engine's own gauges:

    python -m bench.autoscale_e2e calibrate --runtime vllm --out /tmp/cal-vllm.json
    python -m bench.autoscale_e2e run --runtime vllm --calibration /tmp/cal-vllm.json --max-replicas 2 \
        --base-rps 1.5 --json docs/benchmarks/autoscale_e2e_vllm.json \
        --trace-copy docs/benchmarks/autoscale_e2e_vllm_trace.csv
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvfleet.autoscale_replay.engine_model import MEAN_OUTPUT_TOKENS, MEAN_PROMPT_TOKENS, EngineModel
from kvfleet.autoscale_replay.fleet import simulate
from kvfleet.autoscale_replay.policies import KvfleetPolicy
from kvfleet.autoscale_replay.replay import TAIL_S, requests_of
from kvfleet.autoscale_replay.slo import Slo, score
from kvfleet.autoscale_replay.trace import read_csv
from kvfleet.fleet.engine_settings import DEFAULT_MODEL, LOCAL_CLUSTER
from kvfleet.fleet.headers import PRIORITY
from kvfleet.fleet.slo import DEFAULT_SLO_CLASSES
from kvfleet.gateway.config import DEFAULT_CAPS
from kvfleet.loadgen import SSE_DONE, sse_data
from kvfleet.operator.autoscaler import AutoscalingPolicy
from kvfleet.operator.manifests import deployment_name

CLASSES = (("critical", 0.2), ("standard", 0.5), ("sheddable", 0.3))
WORDS = ("apple river stone cloud music garden window paper silver forest orange market winter yellow doctor "
         "engine pocket bridge candle rabbit").split()
FLEET, NAMESPACE = "chat", "kvfleet"


def bursty_trace(base_rps: float, duration_s: int, bursts: list[tuple[int, int, float]], seed: int = 0) -> list[dict]:
    """Poisson arrivals at base_rps, times `factor` inside each (start, seconds, factor) burst; prompts 48-128 and
    outputs 16-64 tokens, uniform; classes 20/50/30 % critical/standard/sheddable."""
    rng, rows, t = random.Random(seed), [], 0.0
    peak = base_rps * max([f for _, _, f in bursts] + [1.0])
    while True:  # thinning: draw at the peak rate, keep with rate(t) / peak
        t += rng.expovariate(peak)
        if t >= duration_s:
            return rows
        factor = next((f for s, d, f in bursts if s <= t < s + d), 1.0)
        if rng.random() < base_rps * factor / peak:
            priority = rng.choices([c for c, _ in CLASSES], [w for _, w in CLASSES])[0]
            rows.append({"t": round(t, 3), "prompt_tokens": rng.randint(48, 128),
                         "output_tokens": rng.randint(16, 64), "priority": priority})


def write_trace(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, ["t", "prompt_tokens", "output_tokens", "priority"])
        w.writeheader()
        w.writerows(rows)


def prompt(words: int, rng: random.Random) -> str:
    """About `words` tokens of text, starting with a random number so no two prompts share a cached prefix."""
    return f"{rng.randint(0, 10**9)} " + " ".join(rng.choice(WORDS) for _ in range(max(1, words - 2)))


async def chat(http: httpx.AsyncClient, url: str, row: dict, overhead: int, rng: random.Random,
               started: float) -> dict:
    """One streaming chat request at its trace time; TTFT from that time to the first content token."""
    await asyncio.sleep(max(0.0, started + row["t"] - time.monotonic()))
    sent = time.monotonic()
    body = {"model": DEFAULT_MODEL, "stream": True, "max_tokens": row["output_tokens"], "ignore_eos": True,
            "temperature": 0.0, "messages": [{"role": "user",
                                              "content": prompt(row["prompt_tokens"] - overhead, rng)}]}
    out = {"t": row["t"], "priority": row["priority"], "lag_s": round(sent - started - row["t"], 3),
           "status": None, "ttft_s": None, "tokens": 0}
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body,
                               headers={PRIORITY: row["priority"]}) as r:
            out["status"] = r.status_code
            async for line in r.aiter_lines():
                if (data := sse_data(line)) in (None, SSE_DONE):
                    continue
                chunk = json.loads(data)
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                    out["tokens"] += 1
                    if out["ttft_s"] is None:
                        out["ttft_s"] = round(time.monotonic() - started - row["t"], 3)
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        out["error"] = f"{type(err).__name__}: {err}"
    return out


def attainment(results: list[dict]) -> dict:
    """Per class: the share answered 200 with a first token within its objective (a refusal or error misses)."""
    out = {}
    for cls, _ in CLASSES:
        rs = [r for r in results if r["priority"] == cls]
        slo = DEFAULT_SLO_CLASSES[next(p for p in DEFAULT_SLO_CLASSES if p.value == cls)].ttft_s
        ok = sum(1 for r in rs if r["status"] == 200 and r["ttft_s"] is not None and r["ttft_s"] <= slo)
        out[cls] = round(ok / len(rs), 4) if rs else None
    return out


VLLM_ENGINE = {"kvCacheMemory": "1Gi", "extraArgs": ["--dtype", "bfloat16"]}  # compiled, as vLLM is run


def fleet_manifest(max_replicas: int, runtime: str = "kvfleet", capacity: dict | None = None) -> dict:
    """The fleet; `capacity` (spec.autoscaling.capacity) for a runtime whose pods do not report theirs."""
    engine = {"maxModelLen": LOCAL_CLUSTER.max_model_len, "maxNumSeqs": LOCAL_CLUSTER.max_num_seqs,
              "kvCacheMemory": LOCAL_CLUSTER.kv_cache_memory} | (VLLM_ENGINE if runtime == "vllm" else {})
    autoscaling = {"enabled": max_replicas > 1, "minReplicas": 1, "maxReplicas": max_replicas,
                   "sloClasses": {"critical": {"ttftSeconds": 1, "attainment": 0.999},
                                  "standard": {"ttftSeconds": 2, "attainment": 0.99},
                                  "sheddable": {"ttftSeconds": 5, "attainment": 0}}}
    if capacity:
        autoscaling["capacity"] = capacity
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceFleet", "metadata": {"name": FLEET},
            "spec": {"model": DEFAULT_MODEL, "replicas": 1, "runtime": runtime, "engine": engine,
                     "autoscaling": autoscaling}}


def start_cluster(max_replicas: int, interval_s: float, runtime: str = "kvfleet", capacity: dict | None = None):
    from kvfleet.fleet.ports import free_port
    from kvfleet.local.cluster import ClusterSpec, LocalCluster

    cluster = LocalCluster(ClusterSpec(fleet_manifest(max_replicas, runtime, capacity), namespace=NAMESPACE,
                                       port=free_port(), autoscale_interval_s=interval_s))
    cluster.start()
    return cluster


def kube(cluster):
    from kubernetes import client, config

    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    return client.AppsV1Api(api), client.CoreV1Api(api), client.CustomObjectsApi(api)


def snapshot(apis) -> dict:
    """The fleet's Deployment replicas, its pods (existing: starting, ready or draining) and the operator's status."""
    apps, core, custom = apis
    dep = apps.read_namespaced_deployment(deployment_name(FLEET), NAMESPACE)
    pods = core.list_namespaced_pod(NAMESPACE).items
    fleet = custom.get_namespaced_custom_object("kvfleet.io", "v1alpha1", NAMESPACE, "inferencefleets", FLEET)
    ready = {p.metadata.name: any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or []))
             for p in pods}
    created = {p.metadata.name: p.metadata.creation_timestamp for p in pods}
    return {"spec": dep.spec.replicas, "ready": dep.status.ready_replicas or 0, "pods": len(pods),
            "ready_pods": sum(ready.values()), "pod_ready": ready, "created": created,
            "status": fleet.get("status") or {}}


def engine_metrics(cluster, apis) -> list[dict]:
    """The capacity gauges of each ready engine pod, read from its /metrics as the operator reads them."""
    from kvfleet.fleet.load import METRICS_QUERY, parse_engine_load
    from kvfleet.fleet.pods import pod_endpoint

    out = []
    for pod in apis[1].list_namespaced_pod(NAMESPACE).items:
        url = pod_endpoint(pod)
        if url:
            text = httpx.get(f"{url}/metrics?{METRICS_QUERY}", timeout=5,
                             headers={"Authorization": f"Bearer {cluster.engine_api_key}"}).text
            load = parse_engine_load(text)
            out.append({"pod": pod.metadata.name, "prefill_tokens_per_s": load.prefill_tokens_per_second,
                        "decode_tokens_per_s_full_batch": load.decode_tokens_per_second_full_batch})
    return out


async def probed(cluster, apis) -> dict:
    """The one engine's capacity measured from outside (`kvfleet bench capacity`), as a vLLM user profiles theirs."""
    from kvfleet.capacity_probe import probe
    from kvfleet.fleet.pods import pod_endpoint

    [url] = [u for u in map(pod_endpoint, apis[1].list_namespaced_pod(NAMESPACE).items) if u]
    measured = await probe(url, DEFAULT_MODEL, LOCAL_CLUSTER.max_num_seqs, cluster.engine_api_key)
    return {"prefill_tokens_per_s": round(measured.prefill_tokens_per_s, 1),
            "decode_tokens_per_s_full_batch": round(measured.decode_tokens_per_s, 1)}


async def calibrate(cluster, apis, runtime: str = "kvfleet") -> dict:
    """One engine alone: prompt overhead of the chat template, decode tokens/s with one sequence, requests/s with
    a full batch and a queue behind it (mean shape of the trace), its capacity probed from outside, and the
    engine's own capacity gauges (kvfleet's engine; vLLM has none: the probe stands in for them)."""
    probe = await probed(cluster, apis)
    rng = random.Random(1)
    async with httpx.AsyncClient(timeout=600) as http:
        sizes = {}
        for words in (20, 100):
            r = await http.post(f"{cluster.url}/v1/chat/completions", json={
                "model": DEFAULT_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content":
                                                                        prompt(words, rng)}]})
            sizes[words] = r.json()["usage"]["prompt_tokens"]
        slope = (sizes[100] - sizes[20]) / 80
        overhead = round(sizes[20] - 20 * slope)
        timings = []
        for _ in range(2):  # one sequence alone: its decode rate between the first and the last token
            t0 = time.monotonic()
            stamps = []
            async with http.stream("POST", f"{cluster.url}/v1/chat/completions", json={
                    "model": DEFAULT_MODEL, "stream": True, "max_tokens": 96, "ignore_eos": True,
                    "messages": [{"role": "user", "content": prompt(64, rng)}]}) as r:
                async for line in r.aiter_lines():
                    if '"content"' in line:
                        stamps.append(time.monotonic() - t0)
            timings.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
        n, shape = 2 * LOCAL_CLUSTER.max_num_seqs, {"t": 0.0, "prompt_tokens": 88, "output_tokens": 40,
                                                    "priority": "standard"}
        rates = []
        for _ in range(2):
            t0 = time.monotonic()
            done = await asyncio.gather(*(chat(http, cluster.url, shape, overhead, rng, time.monotonic())
                                          for _ in range(n)))
            rates.append(sum(1 for d in done if d["status"] == 200) / (time.monotonic() - t0))
    gauges = await asyncio.to_thread(engine_metrics, cluster, apis) if runtime == "kvfleet" else [probe]
    return {"runtime": runtime, "probe": probe, "prompt_overhead_tokens": overhead, "tokens_per_word": round(slope, 3),
            "decode_tokens_per_s_one_sequence": round(max(timings), 2),
            "requests_per_s_full_batch_88_40": round(max(rates), 3), "engine_gauges": gauges}


def engine_model(cal: dict, cold_start_s: float) -> EngineModel:
    """The simulator's engine from the calibration: capacity for its reference shape (136 prompt, 64 output tokens)
    from the engine's prefill and full-batch decode rates, and the batch curve's half-rate point from the decode
    rate of one sequence (a decode step takes a + b x batch: one sequence 1 / (a + b), a full batch m / (a + b m))."""
    g = cal["engine_gauges"][0]
    prefill, full = g["prefill_tokens_per_s"], g["decode_tokens_per_s_full_batch"]
    m, one = LOCAL_CLUSTER.max_num_seqs, cal["decode_tokens_per_s_one_sequence"]
    b = (m / full - 1 / one) / (m - 1)
    a = 1 / one - b
    half = a / b if b > 0 else 1000.0
    capacity = 1 / (MEAN_PROMPT_TOKENS / prefill + MEAN_OUTPUT_TOKENS / full)
    return EngineModel(capacity_rps=round(capacity, 4), max_num_seqs=m, prefill_tokens_per_s=round(prefill, 1),
                       half_rate_batch=round(half, 2), cold_start_s=round(cold_start_s))


def simulator_cli(trace: Path, engine: EngineModel, max_replicas: int, out: Path) -> tuple[list[str], dict]:
    """`kvfleet bench autoscale` as a user runs it (decides every 15 s, starts from 2 pods)."""
    cmd = ["kvfleet", "bench", "autoscale", "--trace", str(trace), "--policy", "kvfleet", "--policy", "oracle",
           "--cold-start", str(engine.cold_start_s), "--capacity", str(engine.capacity_rps),
           "--max-num-seqs", str(engine.max_num_seqs), "--prefill-tokens-per-s", str(engine.prefill_tokens_per_s),
           "--max-replicas", str(max_replicas), "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [*cmd[:-1], "OUT"], json.loads(out.read_text())


def simulator_matched(trace: Path, engine: EngineModel, max_replicas: int, interval_s: int) -> dict:
    """The same simulator set as the local cluster ran: one pod at the start, a decision every interval_s, the
    measured batch curve."""
    t = read_csv(trace)
    policy = KvfleetPolicy(AutoscalingPolicy(min_replicas=1, max_replicas=max_replicas))
    run = simulate(requests_of(t, engine), t.duration_s, policy, engine, 1, interval_s, TAIL_S, DEFAULT_CAPS)
    return score(run, Slo()) | {"max_replicas_used": max(run.pods, default=0), "pods_timeline": run.pods}


async def poll(apis, started: float, timeline: list[dict], decisions: list[dict], starts: dict,
               stop: asyncio.Event) -> None:
    """Every second: the Deployment's replicas, the pods that exist, each pod's creation and first Ready sighting
    (its cold start, to the poll's second), and each new decision of the operator."""
    last = None
    while not stop.is_set():
        tick = time.monotonic()
        try:
            s = await asyncio.to_thread(snapshot, apis)
        except Exception as err:  # noqa: BLE001 - a failed poll is a gap in the timeline, not the end of the run
            print(f"poll failed: {err}", file=sys.stderr)
        else:
            t = round(tick - started, 2)
            timeline.append({"t": t} | {k: s[k] for k in ("spec", "ready", "pods", "ready_pods")})
            for name, ready in s["pod_ready"].items():
                seen = starts.setdefault(name, {"created": s["created"][name], "first_seen_t": t,
                                                "ready_when_first_seen": ready})
                if ready and "ready_t" not in seen and not seen["ready_when_first_seen"]:
                    seen["ready_t"], seen["cold_start_s"] = t, round(time.time() - seen["created"].timestamp(), 1)
            d = (s["status"].get("autoscaler") or {}).get("lastDecision")
            if d and d.get("time") != last:
                last = d.get("time")
                decisions.append({"t": t, "desired": d.get("desired"), "reason": d.get("reason")})
        await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))


def replica_seconds(timeline: list[dict], duration_s: float, key: str = "pods") -> float:
    """Pods that exist, integrated over the trace's seconds (each sample holds until the next)."""
    total = 0.0
    for a, b in zip(timeline, timeline[1:], strict=False):
        lo, hi = max(a["t"], 0.0), min(b["t"], duration_s)
        if hi > lo:
            total += a[key] * (hi - lo)
    return round(total, 1)


async def wait_for_plan(apis, timeout_s: float = 90.0) -> str:
    """Until the operator's latest decision comes from the SLO planner (it needs the engines' capacity gauges)."""
    deadline, reason = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        s = await asyncio.to_thread(snapshot, apis)
        reason = ((s["status"].get("autoscaler") or {}).get("lastDecision") or {}).get("reason") or ""
        if reason.startswith("plan"):
            break
        await asyncio.sleep(1)
    return reason


async def run_e2e(cluster, apis, rows: list[dict], overhead: int, duration_s: float) -> dict:
    rng = random.Random(2)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=2000)) as http:
        warm = {"t": 0.0, "prompt_tokens": 88, "output_tokens": 24, "priority": "standard"}
        await asyncio.gather(*(chat(http, cluster.url, warm, overhead, rng, time.monotonic()) for _ in range(4)))
        await chat(http, cluster.url, warm, overhead, rng, time.monotonic())
        first_reason = await wait_for_plan(apis)
        timeline, decisions, starts, stop = [], [], {}, asyncio.Event()
        started = time.monotonic() + 1.0
        poller = asyncio.create_task(poll(apis, started, timeline, decisions, starts, stop))
        results = await asyncio.gather(*(chat(http, cluster.url, r, overhead, rng, started) for r in rows))
        await asyncio.sleep(max(0.0, started + duration_s + 1 - time.monotonic()))
        stop.set()
        await poller
    status = (await asyncio.to_thread(snapshot, apis))["status"]
    in_trace = [p for p in timeline if p["t"] < duration_s]
    return {"slo_attainment": attainment(results), "replica_seconds": replica_seconds(timeline, duration_s),
            "replica_seconds_spec": replica_seconds(timeline, duration_s, "spec"),
            "max_replicas_used": max((p["pods"] for p in in_trace), default=0),
            "status_codes": {str(c): sum(1 for r in results if r["status"] == c)
                             for c in sorted({r["status"] for r in results}, key=str)},
            "errors": [r["error"] for r in results if "error" in r][:5],
            "max_client_lag_s": max(r["lag_s"] for r in results),
            "cold_start_s": max((p["cold_start_s"] for p in starts.values() if "cold_start_s" in p), default=None),
            "pod_starts": starts, "operator_cold_start_s": status.get("coldStartSeconds"),
            "operator_cold_start_samples": status.get("coldStart"),
            "learned_capacity": ((status.get("autoscaler") or {}).get("planner") or {}).get("capacity"),
            "slo_attainment_status": status.get("sloAttainment"), "first_reason": first_reason,
            "decisions": decisions, "scaling_history": status.get("scalingHistory"), "timeline": timeline,
            "requests": results}


def table(report: dict) -> str:
    sides = {"local cluster (operator every 5 s)": report["e2e"]}
    for key, name in (("simulator_matched", "simulator, same setup, engine calibrated alone"),
                      ("simulator_learned", "simulator, same setup, capacity the operator learned")):
        if key in report:
            sides[name] = report[key]
    if "simulator_cli" in report:
        cli = report["simulator_cli"]["result"]
        sides |= {"`kvfleet bench autoscale` kvfleet (2 pods, 15 s)": cli["kvfleet"],
                  "`kvfleet bench autoscale` oracle": cli["oracle"]}
    lines = ["| run | critical ≤1 s | standard ≤2 s | sheddable ≤5 s | replica-s | max pods |",
             "|---|---|---|---|---|---|"]
    for name, side in sides.items():
        a = side["slo_attainment"]
        lines.append(f"| {name} | " + " | ".join("—" if a[c] is None else f"{100 * a[c]:.1f} %" for c, _ in CLASSES)
                     + f" | {side['replica_seconds']:.0f} | {side['max_replicas_used']} |")
    return "\n".join(lines)


def predict(report: dict) -> dict:
    """The simulator's sides for the report's trace: the engine calibrated alone (the CLI as a user runs it, and
    the same setup as the cluster: 1 pod to start, the cluster's period), and the capacity the operator learned."""
    cal, e2e, n = report["calibration"], report["e2e"], report["fleet"]["spec"]["autoscaling"]["maxReplicas"]
    trace, interval = Path(report["trace"]["csv"]), report["autoscale_interval_s"]
    cold = e2e["cold_start_s"] or e2e["operator_cold_start_s"] or 30.0
    engine = engine_model(cal, cold)
    with tempfile.TemporaryDirectory() as tmp:
        cmd, cli = simulator_cli(trace, engine, n, Path(tmp) / "sim.json")
    out = {"engine_model": dataclasses.asdict(engine), "simulator_cli": {"command": " ".join(cmd), "result": cli},
           "simulator_matched": simulator_matched(trace, engine, n, interval)}
    learned = e2e.get("learned_capacity")
    if learned:
        gauges = [{"prefill_tokens_per_s": learned["prefillTokensPerSecond"],
                   "decode_tokens_per_s_full_batch": learned["decodeTokensPerSecond"]}]
        slow = engine_model(cal | {"engine_gauges": gauges}, cold)
        slow = dataclasses.replace(slow, half_rate_batch=engine.half_rate_batch)  # the curve's shape as measured
        out |= {"engine_model_learned": dataclasses.asdict(slow),
                "simulator_learned": simulator_matched(trace, slow, n, interval)}
    return out


def write_report(report: dict, path: Path) -> None:
    report["table"] = table(report)
    # One top-level key a line: the per-request and per-second lists would run to thousands of lines indented.
    path.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, default=str)}"
                                       for k, v in report.items()) + "\n}\n")
    print(report["table"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["calibrate", "run", "predict"],
                   help="predict: redo the simulator's sides of the report in --json")
    p.add_argument("--out", type=Path, help="calibrate: where the calibration JSON goes")
    p.add_argument("--calibration", type=Path, help="run: the calibration JSON")
    p.add_argument("--json", type=Path, default=Path("docs/benchmarks/autoscale_e2e.json"))
    p.add_argument("--trace-copy", type=Path, default=Path("docs/benchmarks/autoscale_e2e_trace.csv"))
    p.add_argument("--base-rps", type=float, default=0.5)
    p.add_argument("--duration", type=int, default=540)
    p.add_argument("--bursts", default="90:45:4,270:60:3,420:40:5", help="start:seconds:factor,...")
    p.add_argument("--max-replicas", type=int, default=3)
    p.add_argument("--interval", type=int, default=5)
    p.add_argument("--runtime", choices=("kvfleet", "vllm"), default="kvfleet", help="the fleet's spec.runtime")
    args = p.parse_args(argv)
    if args.mode == "calibrate":
        cluster = start_cluster(1, args.interval, args.runtime)
        try:
            cal = asyncio.run(calibrate(cluster, kube(cluster), args.runtime))
        finally:
            cluster.stop()
        args.out.write_text(json.dumps(cal, indent=1))
        print(json.dumps(cal, indent=1))
        return 0
    if args.mode == "predict":
        report = json.loads(args.json.read_text())
        write_report(report | predict(report), args.json)
        return 0
    cal = json.loads(args.calibration.read_text())
    bursts = [tuple(float(x) for x in b.split(":")) for b in args.bursts.split(",")]
    rows = bursty_trace(args.base_rps, args.duration, [(int(s), int(d), f) for s, d, f in bursts])
    write_trace(rows, args.trace_copy)
    if (measured := cal.get("runtime", "kvfleet")) != args.runtime:
        p.error(f"--calibration {args.calibration} measured {measured} engines, not {args.runtime}")
    # vLLM's pods do not report their capacity: the fleet declares what the calibration probed, as a user would
    capacity = None if args.runtime == "kvfleet" else {"prefillTokensPerSecond": cal["probe"]["prefill_tokens_per_s"],
                                                       "decodeTokensPerSecond":
                                                           cal["probe"]["decode_tokens_per_s_full_batch"]}
    cluster = start_cluster(args.max_replicas, args.interval, args.runtime, capacity)
    try:
        e2e = asyncio.run(run_e2e(cluster, kube(cluster), rows, cal["prompt_overhead_tokens"], args.duration))
    finally:
        cluster.stop()
    report = {"trace": {"csv": str(args.trace_copy), "requests": len(rows), "duration_s": args.duration,
                        "base_rps": args.base_rps, "bursts_start_s_factor": bursts},
              "fleet": fleet_manifest(args.max_replicas, args.runtime, capacity), "autoscale_interval_s": args.interval,
              "calibration": cal, "e2e": e2e}
    write_report(report, args.json)  # the cluster's side first: the simulator's can be redone (predict)
    write_report(report | predict(report), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
