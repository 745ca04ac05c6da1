"""With a shared engine token (--api-key / KVFLEET_ENGINE_API_KEY), /v1/*, /tokenize and /detokenize need
`Authorization: Bearer <token>`; /health, /ready, /metrics and the routers' discovery routes stay open."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from kvfleet.engine.server.api_key import is_authorized
from tests.conftest import _engine_args, _launch, _wait_ready, free_port, stop_process

TOKEN = "s3cret-engine-token"


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path):
    """A real engine that takes its token from the environment, as the chart's Secret gives it."""
    port = free_port()
    os.environ["KVFLEET_ENGINE_API_KEY"] = TOKEN
    try:
        proc = _launch(_engine_args(tiny_model_dir, port, ()), port, "engine")
    finally:
        del os.environ["KVFLEET_ENGINE_API_KEY"]
    _wait_ready(proc, 180.0)
    yield proc.url
    stop_process(proc)


def test_without_the_token_the_openai_client_gets_401(engine_url: str) -> None:
    for key in ("wrong-token", TOKEN + "x", ""):
        client = OpenAI(base_url=f"{engine_url}/v1", api_key=key or "none", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            client.completions.create(model="x", prompt="hi", max_tokens=2)
        assert "Authorization: Bearer" in err.value.message
    assert httpx.get(f"{engine_url}/v1/models").status_code == 401


def test_with_the_token_the_openai_client_is_served(engine_url: str) -> None:
    client = OpenAI(base_url=f"{engine_url}/v1", api_key=TOKEN, max_retries=0)
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt="hi", max_tokens=2)
    assert completion.choices[0].finish_reason == "length"


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/get_server_info", "/get_model_info",
                                  "/get_load"])
def test_probes_metrics_and_discovery_stay_open(engine_url: str, path: str) -> None:
    assert httpx.get(f"{engine_url}{path}").status_code == 200


@pytest.mark.parametrize(("path", "body"), [("/tokenize", {"prompt": "secret"}), ("/detokenize", {"tokens": [5]})])
def test_routes_that_carry_prompts_need_the_token(engine_url: str, path: str, body: dict) -> None:
    assert httpx.post(f"{engine_url}{path}", json=body).status_code == 401
    authorized = httpx.post(f"{engine_url}{path}", json=body, headers={"authorization": f"Bearer {TOKEN}"})
    assert authorized.status_code == 200


def test_token_comparison() -> None:
    assert is_authorized(b"Bearer tok", b"tok") and is_authorized(b"bearer  tok ", b"tok")
    assert not is_authorized(b"Basic tok", b"tok") and not is_authorized(None, b"tok")
    assert not is_authorized(b"Bearer tok2", b"tok") and not is_authorized(b"Bearer", b"tok")
