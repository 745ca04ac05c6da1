"""While the model loads or the engine drains, /ready and generation routes answer 503 with Retry-After, and /health
too while it loads (the real app in-process: no model is needed to be in those states)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from kvfleet.engine.server.api_server import ServerState, build_app


def test_loading_engine_is_neither_healthy_nor_ready() -> None:
    """As a vLLM pod, which does not answer until it can serve: routers in front register a worker once /health
    says 200, and Kubernetes' startup probe waits on it."""
    client = TestClient(build_app(ServerState(model_name="m")))
    health = client.get("/health")
    assert health.status_code == 503 and health.json() == {"status": "loading"}
    ready = client.get("/ready")
    assert ready.status_code == 503 and ready.json() == {"status": "loading"}
    response = client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 503 and response.headers["retry-after"] == "2"
    assert "still loading" in response.json()["error"]["message"]
    assert client.get("/metrics").status_code == 200  # scrapable before the model is in


def test_draining_engine_refuses_new_work_with_503() -> None:
    state = ServerState(model_name="m")
    state.draining = True
    client = TestClient(build_app(state))
    assert client.get("/ready").json() == {"status": "draining"}
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert "shutting down" in response.json()["error"]["message"]
    assert 'kvfleet_requests_rejected_total{reason="draining"} 1.0' in client.get("/metrics").text
