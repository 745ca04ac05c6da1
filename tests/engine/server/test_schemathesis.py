"""schemathesis against the engine's own OpenAPI schema: generated requests never get a 5xx or a broken response.

The server runs in this process on the tiny model (real engine, real app, ASGI transport). Cases are drawn
from schemathesis' strategies with plain hypothesis, so the test does not depend on schemathesis' pytest plugin.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks as st_checks

from kvfleet.engine.async_engine import AsyncEngine
from kvfleet.engine.server.api_server import ServerState, build_app
from tests.conftest import make_engine

CHECKS = [st_checks.not_a_server_error, st_checks.response_schema_conformance, st_checks.content_type_conformance]


@pytest.fixture(scope="module")
def api_schema(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    state = ServerState(model_name="tiny")
    adapters = tmp_path_factory.mktemp("allowed-adapters")  # runtime LoRA loading on: its routes run for real
    engine = make_engine(tiny_model_dir, max_num_waiting=64, enable_lora=True, lora_allowed_dirs=[str(adapters)])
    state.engine = AsyncEngine(engine, state.metrics)
    yield schemathesis.openapi.from_asgi("/openapi.json", build_app(state))
    state.engine.shutdown()


def operations(schema) -> dict[str, object]:
    return {f"{op.method.upper()} {op.path}": op for op in (result.ok() for result in schema.get_all_operations())}


def shorten(case) -> None:
    """Keep generation short: clamp valid token limits, leave invalid ones alone."""
    if not isinstance(case.body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        value = case.body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            case.body[key] = min(value, 8)
    if case.body.get("max_tokens") is None and case.body.get("max_completion_tokens") is None:
        case.body["max_tokens"] = 8


# What routers in front ask (vLLM's and SGLang's routes: engine/server/vllm_compat_api.py, sglang_compat_api.py)
PEER_ROUTES = ["GET /kv_event_sources", "GET /get_server_info", "GET /server_info", "GET /model_info",
               "GET /get_model_info", "GET /get_load", "GET /version", "POST /v1/completions/render",
               "POST /v1/chat/completions/render", "POST /tokenize", "POST /detokenize",
               "POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter",
               # sleep mode is off here (404 saying how to turn it on): asleep, every other route would answer 503
               "POST /sleep", "POST /wake_up", "GET /is_sleeping"]


def test_schema_lists_every_route(api_schema) -> None:
    assert set(operations(api_schema)) == {
        "GET /health", "GET /ready", "GET /metrics", "GET /v1/models", "POST /v1/completions",
        "POST /v1/chat/completions", "GET /kv_events", *PEER_ROUTES,
    }


@pytest.mark.parametrize("route", ["GET /health", "GET /ready", "GET /metrics", "GET /v1/models",
                                   "POST /v1/completions", "POST /v1/chat/completions", *PEER_ROUTES])
def test_generated_requests_get_no_5xx_and_valid_responses(api_schema, route: str) -> None:
    operation = operations(api_schema)[route]

    @given(case=operation.as_strategy())
    @settings(max_examples=25 if route.startswith("POST") else 5, deadline=None,
              suppress_health_check=list(HealthCheck), database=None)
    def check(case) -> None:
        shorten(case)
        case.call_and_validate(checks=CHECKS)

    check()


@pytest.mark.parametrize("route", ["POST /v1/completions", "POST /tokenize", "POST /detokenize",
                                   "POST /v1/load_lora_adapter"])
def test_hostile_bodies_from_the_schema_never_crash(api_schema, route: str) -> None:
    """Bodies that break the schema on purpose (schemathesis' negative mode) get 4xx, never 5xx."""
    operation = operations(api_schema)[route]

    @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode.NEGATIVE))
    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case) -> None:
        response = case.call()
        assert response.status_code < 500, response.text

    check()
