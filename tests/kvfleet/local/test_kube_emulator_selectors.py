"""The local Kubernetes API (KMock's emulator, kvfleet/local/kube_emulator.py) honours label selectors on lists and
watches, as a real API server does: without it, every fleet's operator loop and the gateway's discovery saw every
fleet's pods (KMock 0.8 ignores labelSelector)."""

from __future__ import annotations

import pytest
from kubernetes import client, watch

from kvfleet.local.kube_emulator import KubeEmulator, selects


@pytest.mark.parametrize(("selector", "labels", "selected"), [
    ("kvfleet.io/fleet=chat", {"kvfleet.io/fleet": "chat"}, True),
    ("kvfleet.io/fleet==chat", {"kvfleet.io/fleet": "code"}, False),
    ("app=engine,kvfleet.io/fleet=chat", {"app": "engine", "kvfleet.io/fleet": "chat"}, True),
    ("app=engine,kvfleet.io/fleet=chat", {"kvfleet.io/fleet": "chat"}, False),
    ("tier!=gpu", {"tier": "cpu"}, True),
    ("tier!=gpu", {}, True),
    ("tier", {"tier": ""}, True),
    ("!tier", {"tier": "cpu"}, False),
    ("env in (prod, staging),tier notin (gpu)", {"env": "staging", "tier": "cpu"}, True),
    ("env in (prod, staging)", {"env": "dev"}, False),
])
def test_label_selectors_as_kubernetes_reads_them(selector: str, labels: dict, selected: bool) -> None:
    assert selects(selector, labels) is selected


def pod(name: str, fleet: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "llm",
                                                            "labels": {"kvfleet.io/fleet": fleet}},
            "spec": {"containers": [{"name": "engine", "image": "kvfleet/engine:cpu"}]}}


def test_lists_and_watches_return_only_the_selected_fleets_pods() -> None:
    emulator = KubeEmulator().start()
    try:
        core = client.CoreV1Api(emulator.api_client())
        for name, fleet in (("chat-engine-0", "chat"), ("code-engine-0", "code"), ("chat-engine-1", "chat")):
            core.create_namespaced_pod("llm", pod(name, fleet))
        listed = core.list_namespaced_pod("llm", label_selector="kvfleet.io/fleet=chat").items
        assert sorted(p.metadata.name for p in listed) == ["chat-engine-0", "chat-engine-1"]
        assert len(core.list_namespaced_pod("llm").items) == 3
        events = watch.Watch().stream(core.list_namespaced_pod, "llm", label_selector="kvfleet.io/fleet=code",
                                      _request_timeout=10)
        assert next(events)["object"].metadata.name == "code-engine-0"  # the existing one, alone
        core.create_namespaced_pod("llm", pod("chat-engine-2", "chat"))
        core.create_namespaced_pod("llm", pod("code-engine-1", "code"))
        assert next(events)["object"].metadata.name == "code-engine-1"  # chat-engine-2 was not sent
        events.close()
    finally:
        emulator.stop()
