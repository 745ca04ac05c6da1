"""The engine's own failures (a step failing for everyone, the engine thread gone) answer 500 with
`x-kvfleet-fault: engine`, or, mid-stream, an error event then [DONE]: never a silent or truncated end.

The app and engine are real and run in this process (ASGI transport); the fault is injected into the engine's step,
since no request can cause it.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from kvfleet.engine.async_engine import AsyncEngine
from kvfleet.engine.server.api_server import ServerState, build_app
from tests.conftest import make_engine

BODY = {"prompt": "hi", "max_tokens": 4}
pytestmark = pytest.mark.asyncio


@pytest.fixture
def state(tiny_model_dir: Path):
    state = ServerState(model_name="tiny")
    state.engine = AsyncEngine(make_engine(tiny_model_dir), state.metrics)
    yield state
    state.engine.shutdown()


def client(state: ServerState) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state), raise_app_exceptions=False), base_url="http://engine")


def break_steps(state: ServerState, after: int = 0) -> None:
    """Steps fail for the whole batch once `after` steps have run."""
    step, calls = state.engine.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > after:
            raise RuntimeError("injected: the model runner lost its device")
        return step()

    state.engine.engine.step = failing_step


async def test_a_step_failing_for_everyone_is_a_marked_500(state: ServerState) -> None:
    break_steps(state)
    async with client(state) as http:
        response = await http.post("/v1/completions", json=BODY)
    assert response.status_code == 500 and response.headers["x-kvfleet-fault"] == "engine"
    assert response.json()["error"]["code"] == "engine_fault"


async def test_a_stream_cut_by_an_engine_fault_ends_with_an_error_event_then_done(state: ServerState) -> None:
    break_steps(state, after=2)  # the stream has started (first tokens sent) when the engine fails
    async with client(state) as http:
        response = await http.post("/v1/completions", json={**BODY, "max_tokens": 8, "ignore_eos": True,
                                                            "stream": True})
    assert response.status_code == 200
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_fault"


async def test_a_dead_engine_thread_is_a_marked_500(state: ServerState) -> None:
    state.engine.shutdown()
    async with client(state) as http:
        response = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 500 and response.headers["x-kvfleet-fault"] == "engine"
    assert "stopped" in response.json()["error"]["message"]
