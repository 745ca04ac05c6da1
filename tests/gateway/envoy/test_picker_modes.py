"""The picker behind an Envoy configured as a Gateway API Inference Extension gateway configures its endpoint picker
(issue 22, `gateway.mode: inferencePool`): request body FULL_DUPLEX_STREAMED, response headers SEND, response body
FULL_DUPLEX_STREAMED, trailers SEND. A real Envoy in front of `kvfleet gateway --data-plane picker` and a real
tiny-model engine: completions and streams arrive whole, a body in several chunks routes, refusals are the
picker's, and a mode that cannot route by body gets a clear 500 instead of a hang."""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.envoy.bootstrap import PICKER_MESSAGE_TIMEOUT_S, build_bootstrap
from kvfleet.gateway.envoy.eds import envoy_address, write_endpoints
from kvfleet.gateway.envoy.front import envoy_binary
from kvfleet.local.supervisor import spawn
from tests.conftest import free_port, start_engine_servers, start_gateway, stop_process
from tests.support.clients import complete
from tests.support.engines import LONG, saturated
from tests.support.gateways import wait_until_routable
from tests.support.polling import until

# What an Inference Extension gateway sets for its picker (FULL_DUPLEX_STREAMED needs request trailers SEND).
INFERENCE_GATEWAY_MODE = {"request_header_mode": "SEND", "request_body_mode": "FULL_DUPLEX_STREAMED",
                          "request_trailer_mode": "SEND", "response_header_mode": "SEND",
                          "response_body_mode": "FULL_DUPLEX_STREAMED", "response_trailer_mode": "SEND"}
MAX_BODY = 400_000  # the picker's --max-body-bytes: Envoy streams the body, the picker bounds it


def inference_gateway_bootstrap(tmp_path: Path, engine: str, picker_port: int, port: int, mode: dict) -> Path:
    """kvfleet's own bootstrap made into a foreign gateway's: the given processing mode, and none of kvfleet's Lua
    filter or access logs (a foreign gateway has neither); the engine in its EDS file as an InferencePool's."""
    engines = tmp_path / "engines" / "engines.json"
    engines.parent.mkdir(exist_ok=True)
    write_endpoints(engines, [envoy_address(engine)])
    config = build_bootstrap(GatewayConfig(), "127.0.0.1", port, picker_port, free_port(), free_port(), engines)
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc, router = manager["http_filters"][0], manager["http_filters"][-1]
    ext_proc["typed_config"]["processing_mode"] = mode
    ext_proc["typed_config"].pop("metadata_options")
    router["typed_config"].pop("upstream_log")
    manager["http_filters"] = [ext_proc, router]
    manager.pop("access_log")
    path = tmp_path / f"envoy-{port}.json"
    path.write_text(json.dumps(config))
    return path


def start_envoy(bootstrap: Path, port: int):
    envoy = spawn("envoy", [envoy_binary(), "-c", str(bootstrap), "--disable-hot-restart", "--log-level", "warn"],
                  url=f"http://127.0.0.1:{port}", new_session=False, tail_lines=50)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2)  # the app's, through Envoy
            return envoy
        except httpx.TransportError:
            time.sleep(0.1)
    envoy.stop(5)
    raise AssertionError("Envoy never listened")


@pytest.fixture(scope="module")
def picker(tiny_server: str):
    picker_port = free_port()
    proc, url = start_gateway("--engine", tiny_server, "--data-plane", "picker", "--picker-port", str(picker_port),
                              "--max-body-bytes", str(MAX_BODY), timeout=90.0)
    wait_until_routable(url)
    yield picker_port
    stop_process(proc)


@pytest.fixture(scope="module")
def gateway(picker: int, tiny_server: str, tmp_path_factory) -> str:
    port = free_port()
    bootstrap = inference_gateway_bootstrap(tmp_path_factory.mktemp("duplex"), tiny_server, picker, port,
                                            INFERENCE_GATEWAY_MODE)
    envoy = start_envoy(bootstrap, port)
    yield f"http://127.0.0.1:{port}"
    envoy.stop(10)


@pytest.fixture(scope="module")
def model(tiny_server: str) -> str:
    return httpx.get(f"{tiny_server}/v1/models").json()["data"][0]["id"]


def test_envoy_validates_the_inference_gateways_mode(tiny_server: str, tmp_path: Path) -> None:
    bootstrap = inference_gateway_bootstrap(tmp_path, tiny_server, free_port(), free_port(), INFERENCE_GATEWAY_MODE)
    done = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(bootstrap)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_completion_arrives_whole_through_the_duplex_picker(gateway: str, tiny_server: str, model: str) -> None:
    # a body `priority` from a client without the right is dropped: the picker's rewritten body goes on
    r = httpx.post(f"{gateway}/v1/completions", timeout=60,
                   json={"model": model, "prompt": "hello", "max_tokens": 3, "ignore_eos": True, "priority": 7})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert r.headers["x-kvfleet-engine"] == tiny_server  # the picker's route, taken by Envoy


def test_a_stream_arrives_whole_through_the_duplex_picker(gateway: str, model: str) -> None:
    with httpx.stream("POST", f"{gateway}/v1/completions", timeout=60,
                      json={"model": model, "prompt": "hello", "max_tokens": 5, "ignore_eos": True,
                            "stream": True}) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in events[:-1]) >= 1
    assert len(events) - 1 == 5  # one event per token, none lost or repeated in the picker's echo


def test_a_refusal_is_the_pickers_openai_400(gateway: str, model: str) -> None:
    r = httpx.post(f"{gateway}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": "4"}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"


def test_a_body_of_many_chunks_reaches_the_engine_whole(gateway: str, tiny_server: str, model: str) -> None:
    prompt = "hello " * 50_000  # 300 KB: Envoy streams it in several chunks, the picker answers it in several
    r = httpx.post(f"{gateway}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1},
                   timeout=60)
    assert r.headers.get("x-kvfleet-engine") == tiny_server, r.text  # the engine's answer, not the picker's
    # the tiny engine's context is short: its refusal counts the prompt it received, every character of it
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "prompt has 300000 characters" in r.json()["error"]["message"]


def test_a_chunked_body_without_content_length_routes(gateway: str, tiny_server: str, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 2, "ignore_eos": True}).encode()
    r = httpx.post(f"{gateway}/v1/completions", content=iter([body[:20], body[20:]]), timeout=60,
                   headers={"content-type": "application/json"})  # an iterator: Transfer-Encoding chunked
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2 and r.headers["x-kvfleet-engine"] == tiny_server


def test_a_body_over_the_limit_is_413_from_the_picker(gateway: str, model: str) -> None:
    r = httpx.post(f"{gateway}/v1/completions", json={"model": model, "prompt": "x" * MAX_BODY, "max_tokens": 1},
                   timeout=30)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_a_streamed_request_body_mode_gets_a_clear_500(picker: int, tiny_server: str, model: str,
                                                       tmp_path: Path) -> None:
    port = free_port()
    mode = {**INFERENCE_GATEWAY_MODE, "request_body_mode": "STREAMED", "response_body_mode": "STREAMED"}
    envoy = start_envoy(inference_gateway_bootstrap(tmp_path, tiny_server, picker, port, mode), port)
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                       json={"model": model, "prompt": "hello", "max_tokens": 1})
    finally:
        envoy.stop(10)
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "unsupported_processing_mode"
    assert "FULL_DUPLEX_STREAMED" in r.json()["error"]["message"]


def test_a_queued_request_is_held_and_released_through_the_duplex_picker(tiny_model_dir, model,
                                                                         tmp_path: Path) -> None:
    """The fleet queue behind a duplex gateway: the headers phase waits for its answer while the request queues
    (past the gateway's message timeout, which the picker extends), then the request goes to the engine."""
    [(engine, engine_url)] = start_engine_servers(tiny_model_dir, ("--max-num-seqs", "1", *LONG))
    picker_port, port = free_port(), free_port()
    proc, url = start_gateway("--engine", engine_url, "--data-plane", "picker", "--picker-port", str(picker_port),
                              "--saturation-queue", "1", timeout=90.0)
    envoy = None
    try:
        wait_until_routable(url)
        envoy = start_envoy(inference_gateway_bootstrap(tmp_path, engine_url, picker_port, port,
                                                        INFERENCE_GATEWAY_MODE), port)
        with ThreadPoolExecutor(1) as pool:
            with saturated(engine_url, model, (url,), holders=3, until_exit=True):  # past the message timeout
                queued = pool.submit(complete, f"http://127.0.0.1:{port}", model, "queued", 4, 60)
                until(lambda: httpx.get(f"{url}/ready").json()["queued"] == 1, "the request never queued")
                time.sleep(PICKER_MESSAGE_TIMEOUT_S + 1.0)
                assert not queued.done()  # still held: the gateway did not time the picker out
            response, _ = queued.result(timeout=60)
        assert isinstance(response, httpx.Response) and response.status_code == 200, response
        assert response.json()["usage"]["completion_tokens"] == 4
    finally:
        if envoy is not None:
            envoy.stop(10)
        stop_process(proc)
        stop_process(engine)
