"""schemathesis against the engine's own OpenAPI schema: generated requests never get a 5xx or a broken response.

The server runs in this process on the tiny model (real engine, real app, ASGI transport).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks as st_checks

from kvfleet.engine.api_server import ServerState, build_app
from kvfleet.engine.async_engine import AsyncEngine
from tests.conftest import make_engine

MODEL = "tiny"


@pytest.fixture(scope="module")
def app(tiny_model_dir: Path):
    state = ServerState(model_name=MODEL)
    state.engine = AsyncEngine(make_engine(tiny_model_dir, max_num_waiting=64), state.metrics)
    yield build_app(state)
    state.engine.shutdown()


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(scope="module")
def api_schema(app):
    return schemathesis.openapi.from_asgi("/openapi.json", app)


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_generated_requests_get_no_5xx_and_valid_responses(case) -> None:
    if isinstance(case.body, dict):  # keep generation short: clamp valid token limits, leave invalid ones alone
        for key in ("max_tokens", "max_completion_tokens"):
            value = case.body.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                case.body[key] = min(value, 8)
        if case.body.get("max_tokens") is None and case.body.get("max_completion_tokens") is None:
            case.body["max_tokens"] = 8
    case.call_and_validate(checks=[st_checks.not_a_server_error, st_checks.response_schema_conformance,
                                   st_checks.content_type_conformance])
