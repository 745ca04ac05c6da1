"""What a user of kvfleet on Kubernetes sees, through the gateway and the API server, in order:
chat works; load scales the fleet up; deleting an engine pod under load loses no request; sheddable traffic is
shed under overload; idle scales down; (on a real cluster) `helm uninstall` leaves nothing behind.

The tests run in file order and share one fleet: later ones start from where earlier ones left it.
"""

from __future__ import annotations

import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from kubernetes import client

from kvfleet.operator.fleet_spec import GROUP, PLURAL, VERSION

LOAD_TIMEOUT_S = float(os.environ.get("KVFLEET_E2E_SCALE_TIMEOUT", "180"))


def openai_client(target, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{target.gateway_url}/v1", api_key="unused", max_retries=retries, timeout=300)


def fleet(target) -> dict:
    return client.CustomObjectsApi(target.api_client()).get_namespaced_custom_object(
        GROUP, VERSION, target.namespace, PLURAL, target.fleet)


def scaled_to(fleet_object: dict) -> int | None:
    """The replicas of the last scaling decision, once both spec and status show it."""
    history = (fleet_object.get("status") or {}).get("scalingHistory") or []
    replicas = fleet_object["spec"].get("replicas", 1)
    return replicas if history and history[-1]["to"] == replicas else None


def fleet_when(target, predicate, what: str) -> dict:
    def check() -> dict | None:
        current = fleet(target)
        return current if predicate(current) else None
    return eventually(check, LOAD_TIMEOUT_S, what, target)


def patch_autoscaling(target, **settings) -> None:
    client.CustomObjectsApi(target.api_client()).patch_namespaced_custom_object(
        GROUP, VERSION, target.namespace, PLURAL, target.fleet, {"spec": {"autoscaling": settings}})


def fleet_pods(target) -> list:
    """The fleet's pods not being deleted, ready or not."""
    pods = client.CoreV1Api(target.api_client()).list_namespaced_pod(
        target.namespace, label_selector=f"kvfleet.io/fleet={target.fleet}").items
    return [p for p in pods if p.metadata.deletion_timestamp is None]


def engine_pods(target) -> list:
    """The fleet's ready pods."""
    return [p for p in fleet_pods(target)
            if any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or []))]


def eventually(check, timeout: float, what: str, target=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.5)
    where = f"; local cluster logs: {target.logs}" if target is not None and target.logs else ""
    raise AssertionError(f"not within {timeout:.0f} s: {what}{where}")


def chat(target, content: str, max_tokens: int, priority: str = "standard") -> httpx.Response:
    """One request as raw HTTP, so the status and headers of a shed answer can be read."""
    wait = {} if target.max_queue_ms is None else {"x-kvfleet-max-queue-ms": str(target.max_queue_ms)}
    return httpx.post(f"{target.gateway_url}/v1/chat/completions", timeout=300,
                      headers={"x-kvfleet-priority": priority, **wait},
                      json={"model": target.model, "max_tokens": max_tokens, "temperature": 0,
                            "messages": [{"role": "user", "content": content}]})


def test_chat_works_with_the_openai_client(target) -> None:
    raw = openai_client(target).chat.completions.with_raw_response.create(
        model=target.model, max_tokens=16, temperature=0,
        messages=[{"role": "user", "content": "Name a colour."}])
    answer = raw.parse()
    assert answer.choices[0].message.content.strip()
    assert answer.model == target.model and answer.usage.completion_tokens > 0
    if os.environ.get("KVFLEET_E2E_GATEWAY_MODE") != "inferencePool":  # another Gateway's Envoy does not add it
        assert raw.headers.get("x-kvfleet-engine")  # the pod that served it
    models = [m.id for m in openai_client(target).models.list()]
    assert target.model in models


def test_load_raises_kv_usage_and_the_operator_scales_up(target) -> None:
    # Targets low enough that 24 concurrent requests exceed them on the CPU example fleet and the local one.
    patch_autoscaling(target, minReplicas=1, maxReplicas=2, targetQueuePerReplica=2, targetKVCacheUsage=0.15,
                      scaleDownStabilizationSeconds=600)
    start = fleet(target)["spec"].get("replicas", 1)
    assert start == 1, f"the scenario starts from one replica, not {start}"
    stop = time.monotonic() + LOAD_TIMEOUT_S
    statuses: list[int] = []
    refusals: list[str] = []
    fleet_replicas = [start]

    def keep_busy(k: int) -> None:
        while time.monotonic() < stop and fleet_replicas[0] < 2:
            answer = chat(target, f"Write a long story about ship number {k}.", 48)
            statuses.append(answer.status_code)
            if answer.status_code != 200:
                refusals.append(answer.text[:300])

    with ThreadPoolExecutor(24) as pool:
        futures = [pool.submit(keep_busy, k) for k in range(24)]
        f = fleet_when(target, lambda o: scaled_to(o) == 2, "the fleet scaled to 2 replicas under load")
        fleet_replicas[0] = f["spec"]["replicas"]
        for future in futures:
            future.result()
    history = f["status"].get("scalingHistory") or []
    assert history and history[-1]["to"] == 2 and history[-1]["from"] == 1
    assert history[-1]["reason"].split(":")[0] in ("up", "burst"), history[-1]
    assert statuses and all(s == 200 for s in statuses), (sorted(set(statuses)), refusals[:3])
    eventually(lambda: len(engine_pods(target)) == 2, LOAD_TIMEOUT_S, "two ready engine pods", target)


def test_deleting_an_engine_pod_under_load_loses_no_request(target, replacement_ready: bool = True) -> None:
    """`replacement_ready=False` (a runtime that takes minutes to start): the replacement pod must exist, not be
    ready yet; the scale-down after removes it first, as a ReplicaSet removes a pod that is not ready."""
    pods = eventually(lambda: (lambda p: p if len(p) == 2 else None)(engine_pods(target)), LOAD_TIMEOUT_S,
                      "two ready engine pods", target)
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(chat, target, f"Count slowly from {k} to {k + 40}.", 32) for k in range(12)]
        time.sleep(2.0)  # requests are in flight on both pods
        client.CoreV1Api(target.api_client()).delete_namespaced_pod(pods[0].metadata.name, target.namespace)
        more = [pool.submit(chat, target, f"Say hello to {k}.", 8) for k in range(6)]  # during the deletion
        answers = [f.result() for f in futures + more]
    assert [a.status_code for a in answers] == [200] * len(answers), [a.text[:200] for a in answers]
    # every answer whole: ended by the model or its length (its text is the model's: greedy decoding in a batch that
    # the deletion reshuffled may choose the end of text first, an empty answer); never `abort` (vLLM answers a
    # request it drops as its pod stops 200, finish_reason "abort"): the pod leaves the gateway's engines during its
    # preStop sleep, before its engine gets SIGTERM, and the engine finishes what it holds within its grace; an
    # answer cut off is sent again whole (the Python plane also resends an aborted one)
    assert all(a.json()["choices"][0]["finish_reason"] in ("stop", "length")
               and isinstance(a.json()["choices"][0]["message"]["content"], str) for a in answers), \
        [a.text[:300] for a in answers]
    if not target.on_kind:  # one gateway, whose counters are the fleet's
        # and none needed migrating: the pod left the gateway's engines during its preStop sleep, before its engine
        # got SIGTERM, and the engine finished what it held within its grace
        migrated = [line for line in httpx.get(f"{target.gateway_url}/metrics", timeout=10).text.splitlines()
                    if line.startswith("kvfleet_gateway_migrations_total{") and not line.endswith(" 0.0")]
        assert not migrated, migrated
    if not replacement_ready:
        eventually(lambda: len(fleet_pods(target)) == 2 and pods[0].metadata.name not in
                   {p.metadata.name for p in fleet_pods(target)}, LOAD_TIMEOUT_S, "a replacement pod", target)
        return
    eventually(lambda: len(engine_pods(target)) == 2 and pods[0].metadata.name not in
               {p.metadata.name for p in engine_pods(target)}, LOAD_TIMEOUT_S, "a replacement pod, ready", target)


def gateway_queued(target) -> int:
    """Requests the gateway holds in its fleet queue, as its /ready reports them."""
    return int(httpx.get(f"{target.gateway_url}/ready", timeout=10).json().get("queued", 0))


def test_sheddable_traffic_is_shed_under_overload_and_standard_is_served(target) -> None:
    spec = fleet(target)["spec"]
    # Every engine slot taken, 8 more waiting in each engine (the gateway counts 5 as saturated), and more queued
    # at the gateway.
    overload = spec["replicas"] * (spec.get("engine", {}).get("maxNumSeqs", 128) + 8) + 8
    with ThreadPoolExecutor(overload) as pool, ThreadPoolExecutor(8) as side:
        standard = [pool.submit(chat, target, f"Tell a long tale about castle {k}.", 48) for k in range(overload)]
        # The overload is on once the gateway holds requests in its queue (sending the burst takes a while on a
        # busy machine; a sheddable request routed before that would wait behind every standard one).
        eventually(lambda: gateway_queued(target) > 0 or all(f.done() for f in standard), LOAD_TIMEOUT_S,
                   "the gateway queued requests under the overload", target)
        sheddable = []  # sent a few per second while the overload lasts, until three are shed
        while (not all(f.done() for f in standard) and len(sheddable) < 40
               and sum(f.done() and f.result().status_code != 200 for f in sheddable) < 3):
            sheddable.append(side.submit(chat, target, f"Summarise item {len(sheddable)}.", 8, "sheddable"))
            time.sleep(0.3)
        standard_answers = [f.result() for f in standard]
        sheddable_answers = [f.result() for f in sheddable]
    shed = [a for a in sheddable_answers if a.status_code in (429, 503)]
    assert shed, (f"no sheddable request was shed during the overload: {[a.status_code for a in sheddable_answers]}; "
                  f"standard: {sorted(a.status_code for a in standard_answers)}")
    assert all(a.status_code in (200, 429, 503) for a in sheddable_answers), [a.text[:200] for a in sheddable_answers]
    for answer in shed:
        assert int(answer.headers["retry-after"]) >= 1
        assert answer.json()["error"]["message"]
    assert [a.status_code for a in standard_answers] == [200] * overload


def test_idle_traffic_scales_down(target) -> None:
    # the windows at their shortest useful values, so the scenario waits seconds, not the defaults' minute
    patch_autoscaling(target, scaleDownStabilizationSeconds=10, stableWindowSeconds=6)
    f = fleet_when(target, lambda o: scaled_to(o) == 1, "the idle fleet scaled back to 1 replica")
    assert f["status"]["scalingHistory"][-1]["reason"].startswith("down"), f["status"]["scalingHistory"][-1]
    eventually(lambda: len(engine_pods(target)) == 1, LOAD_TIMEOUT_S, "one engine pod left", target)
    assert chat(target, "Still there?", 4).status_code == 200


def test_helm_uninstall_leaves_nothing_behind(target) -> None:
    if not target.on_kind:
        pytest.skip("needs a real cluster with the chart installed (e2e/kind.sh); the local cluster has no helm "
                    "release, and tests/kvfleet/local/test_cluster.py checks that stopping it leaves no process behind")
    release, namespace = os.environ.get("KVFLEET_E2E_RELEASE", "kvfleet"), target.namespace
    apps, core = client.AppsV1Api(target.api_client()), client.CoreV1Api(target.api_client())
    client.CustomObjectsApi(target.api_client()).delete_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, target.fleet)
    eventually(lambda: not apps.list_namespaced_deployment(namespace, label_selector=f"kvfleet.io/fleet="
                                                            f"{target.fleet}").items,
               120, "the fleet's Deployment garbage-collected")
    subprocess.run(["helm", "uninstall", release, "-n", namespace, "--wait"], check=True)
    selector = f"app.kubernetes.io/instance={release}"
    eventually(lambda: not (apps.list_namespaced_deployment(namespace, label_selector=selector).items
                            or apps.list_namespaced_stateful_set(namespace, label_selector=selector).items
                            or core.list_namespaced_service(namespace, label_selector=selector).items
                            or core.list_namespaced_pod(namespace).items),
               180, "no Deployment, StatefulSet, Service or Pod of the release left")
