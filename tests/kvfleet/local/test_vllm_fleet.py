"""The fleet on real vLLM engines: `kvfleet up --runtime vllm` (two vLLM engines, one core each, behind kvfleet's
gateway), asked as a user would, with the official OpenAI client where it applies. vLLM's own counters are the
referee: the prefix hits the gateway's index predicts are the hits vLLM then reports.

The engines start once for the session (tests/support/vllm_engines.py); every test leaves them idle."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
import uuid

import httpx
import openai
import pytest

from kvfleet.fleet import headers
from kvfleet.gateway.routing.pick import SaturationPolicy
from kvfleet.operator.fleet_spec import parse_fleet
from tests.conftest import start_engine_server, start_gateway, stop_process
from tests.support.commands import capacity_command
from tests.support.engines import hold_stream, saturated
from tests.support.polling import until
from tests.support.processes import alive, group_members
from tests.support.vllm_engines import BLOCK_SIZE, MAX_NUM_SEQS, SERVED, START_TIMEOUT_S, metric

CHUNK_FIELDS = {"id", "object", "created", "model", "choices", "usage"}  # an OpenAI stream chunk's


@pytest.fixture
def vllm(vllm_fleet):
    vllm_fleet.wait_idle()
    yield vllm_fleet
    vllm_fleet.wait_idle()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def system_prompt(words: int = 450) -> str:
    """A prompt of its own per call, several of vLLM's 128-token blocks long."""
    tag = uuid.uuid4().hex[:8]
    return " ".join(f"Rule {k} of deployment {tag}: answer briefly." for k in range(words // 6))


def test_up_serves_chat_streams_and_completions_from_vllm_through_the_gateway(vllm) -> None:
    c = client(vllm.url)
    chat = c.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Say hi."}], max_tokens=5)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.choices[0].message.content
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    assert 0 < chat.usage.completion_tokens <= 5
    chunks = list(c.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Count to 9."}],
                                            max_tokens=6, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    text = c.completions.create(model=SERVED, prompt="The capital of France is", max_tokens=3, temperature=0)
    assert text.usage.completion_tokens == 3 and text.choices[0].finish_reason == "length"


def test_vllm_engines_answer_only_with_the_fleets_token(vllm) -> None:
    body = {"model": SERVED, "prompt": "Hi", "max_tokens": 1}
    assert httpx.post(f"{vllm.engines[0]}/v1/completions", json=body, timeout=30).status_code == 401
    assert httpx.post(f"{vllm.engines[0]}/v1/completions", json=body, headers=vllm.token, timeout=30).status_code == 200


def test_a_vllm_engine_keeps_an_idle_connection_past_its_own_default_keep_alive(vllm) -> None:
    """vLLM closes a connection idle for 5 s by default, shorter than the gateway's pools keep one (Envoy's, the
    Python proxy's): a request sent as vLLM closes it fails unanswered and is retried on another engine, a saturated
    one if that is all there is. The engines kvfleet starts keep one as long as kvfleet's own servers."""
    body = {"model": SERVED, "prompt": "Hi", "max_tokens": 1}
    connects: list[str] = []  # httpx's trace events of the connections the client opens

    def trace(event: str, info: dict) -> None:
        if event == "connection.connect_tcp.started":
            connects.append(event)
    # a client that keeps its own idle connections a minute (httpx's default: 5 s)
    with httpx.Client(headers=vllm.token, timeout=30, limits=httpx.Limits(keepalive_expiry=60)) as c:
        first = c.post(f"{vllm.engines[0]}/v1/completions", json=body, extensions={"trace": trace})
        time.sleep(7)  # idle past vLLM's default
        second = c.post(f"{vllm.engines[0]}/v1/completions", json=body, extensions={"trace": trace})
    assert first.status_code == second.status_code == 200
    assert len(connects) == 1, "vLLM closed the idle connection: the second request needed a new one"


def test_a_request_vllm_refuses_gets_vllms_400_and_the_engine_stays_in_the_fleet(vllm) -> None:
    c = client(vllm.url)
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=10**6)
    assert refused.value.status_code == 400 and "max" in str(refused.value.body).lower()
    healthy = httpx.get(f"{vllm.url}/ready", timeout=10).json()["healthy"]
    assert healthy == 2  # the request's failure, not the engine's
    assert c.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)


def test_the_gateway_follows_vllms_kv_events_and_the_hits_it_predicts_are_the_hits_vllm_reports(vllm) -> None:
    system = system_prompt()
    first = ask(vllm.url, system, "First question?")
    assert_second_question_hits_as_predicted(vllm, vllm.url, first.headers[headers.ENGINE], system)


def ask(url: str, system: str, question: str, auth: dict | None = None) -> httpx.Response:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    answer = httpx.post(f"{url}/v1/chat/completions", json={"model": SERVED, "messages": messages, "max_tokens": 1},
                        headers=auth, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer


def assert_second_question_hits_as_predicted(vllm, gateway: str, engine: str, system: str) -> None:
    """`engine` served a first question under `system`: the gateway's index holds the blocks both questions share
    (counted by vLLM's own tokenizer and chat template), sends a second question there as a precise prefix match,
    and vLLM then reports exactly those blocks' tokens as hits."""
    k = vllm.engines.index(engine)
    tokens = [httpx.post(f"{engine}/tokenize", headers=vllm.token, timeout=30, json={
        "model": SERVED, "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}
    ).json()["tokens"] for q in ("First question?", "A second one?")]
    shared = next(n for n, (a, b) in enumerate(zip(*tokens, strict=False)) if a != b)
    full_blocks = shared // BLOCK_SIZE
    assert full_blocks >= 3, shared
    wait_for_blocks(gateway, engine, full_blocks)  # the index has followed vLLM's events of the first prompt
    hits_before = vllm.engine_metric(k, "vllm:prefix_cache_hits_total")
    precise_before = metric(gateway, "kvfleet_gateway_routing_decisions_total", reason="prefix_precise")
    second = ask(gateway, system, "A second one?")
    assert second.headers[headers.ENGINE] == engine
    assert metric(gateway, "kvfleet_gateway_routing_decisions_total", reason="prefix_precise") == precise_before + 1
    assert vllm.engine_metric(k, "vllm:prefix_cache_hits_total") - hits_before == full_blocks * BLOCK_SIZE


def fleet_full(vllm, requests: int) -> bool:
    """All `requests` are in vLLM's engines or the gateway's queue, and the gateway has no room for another."""
    ready = httpx.get(f"{vllm.url}/ready", timeout=10).json()
    in_vllm = sum(vllm.engine_metric(k, name) for k in range(len(vllm.engines))
                  for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
    return ready["queued"] + in_vllm == requests and (ready["queued"] > 0 or ready["available"] == 0)


def fleet_view(vllm) -> dict:
    """What a failure should show: vLLM's own running and waiting counts, the gateway's /ready and its decisions."""
    return {"vllm": [(e, vllm.engine_metric(k, "vllm:num_requests_running"),
                      vllm.engine_metric(k, "vllm:num_requests_waiting")) for k, e in enumerate(vllm.engines)],
            "ready": httpx.get(f"{vllm.url}/ready", timeout=10).json(),
            "saturated": metric(vllm.url, "kvfleet_gateway_endpoints", state="saturated"),
            **{name: metric(vllm.url, name) for name in (
                "kvfleet_gateway_retries_total", "kvfleet_gateway_migrations_total",
                "kvfleet_gateway_queue_wait_seconds_count")},
            **{f"scrape age {e}": metric(vllm.url, "kvfleet_gateway_scrape_age_seconds", endpoint=e)
               for e in vllm.engines}}


def wait_for_blocks(url: str, engine: str, blocks: int, timeout_s: float = 10.0) -> None:
    wait_until(lambda: index_blocks(url, engine) >= blocks, timeout_s,
               f"the gateway's index never held {blocks} blocks of {engine}")


def index_blocks(url: str, engine: str) -> float:
    return metric(url, "kvfleet_gateway_kv_index_blocks", endpoint=engine)


def wait_until(check, timeout_s: float, failure: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(failure)
        time.sleep(0.1)


def test_a_fleet_of_full_vllm_engines_holds_requests_in_the_gateways_queue_not_in_vllms(vllm) -> None:
    """Both engines full (their batches and as many waiting as the gateway allows): the gateway reads vLLM's running
    and waiting counts and its own dispatches, and holds further requests in its fleet queue, not in vLLM's waiting
    lists; as the slots free, each is released and answered. Long streams hold the slots until the test lets them
    go, so nothing here depends on how fast the machine sends a burst or vLLM decodes."""
    import concurrent.futures

    max_waiting = SaturationPolicy().max_queue
    per_engine = MAX_NUM_SEQS + max_waiting  # what one engine takes before the gateway counts it saturated
    stop = threading.Event()
    holders = [threading.Thread(target=hold_stream, args=(vllm.url, SERVED, stop, 1800)) for _ in range(2 * per_engine)]
    body = {"model": SERVED, "messages": [{"role": "user", "content": "Write a long story about a fleet."}],
            "max_tokens": 4, "ignore_eos": True}
    queued_before = metric(vllm.url, "kvfleet_gateway_queue_wait_seconds_count")
    with concurrent.futures.ThreadPoolExecutor(per_engine) as pool:
        try:
            for t in holders:
                t.start()
            # full as the gateway judges it: every holder in a vLLM engine or in its queue, and no room for more (no
            # engine available, or requests queued: once it has learnt an engine's batch size it releases to its free
            # slots and one waiting, so holders sent one by one fill vLLM's batches and queue the rest)
            until(lambda: fleet_full(vllm, len(holders)), "the gateway never counted both vLLM engines full",
                  timeout=120)
            # the client says how long it will wait: where vLLM is slow (an AVX2-only CPU emulates its bfloat16) the
            # holders may take longer to let go than the gateway's default 30 s
            answers = [pool.submit(httpx.post, f"{vllm.url}/v1/chat/completions", json=body, timeout=300,
                                   headers={headers.MAX_QUEUE_MS: "240000"}) for _ in range(per_engine)]
            seen: list[tuple[int, list[tuple[float, float]]]] = []

            def all_placed() -> bool:
                """Every request is in a vLLM engine or in the gateway's queue, the new ones at least in the queue
                (the gateway may hold a holder a moment, until a scrape shows the engine took the ones before it)."""
                queued = httpx.get(f"{vllm.url}/ready", timeout=10).json()["queued"]
                seen.append((queued, [(vllm.engine_metric(k, "vllm:num_requests_running"),
                                       vllm.engine_metric(k, "vllm:num_requests_waiting"))
                                      for k in range(len(vllm.engines))]))
                in_vllm = sum(r + w for r, w in seen[-1][1])
                return queued >= per_engine and queued + in_vllm == len(holders) + per_engine
            try:
                until(all_placed, "the gateway did not queue the requests the full engines had no room for", timeout=90)
            except AssertionError as err:  # what it saw last: (queued, [(running, waiting) of each engine])
                raise AssertionError(f"{err}: {seen[-3:]}") from None
            waiting = [w for _, w in seen[-1][1]]
            assert all(w <= max_waiting for w in waiting), f"vLLM's own waiting lists held {waiting}: {seen}"
            assert not any(a.done() for a in answers)
            # vLLM does not say its batch size: the gateway learnt it, having seen each engine run it with more waiting
            capacity = [metric(vllm.url, "kvfleet_gateway_engine_batch_capacity", endpoint=e) for e in vllm.engines]
            assert capacity == [MAX_NUM_SEQS] * 2, capacity
        finally:
            stop.set()  # the holders leave: vLLM aborts them and frees their slots
            for t in holders:
                t.join()
        results = [a.result() for a in answers]
    assert [a.status_code for a in results] == [200] * per_engine, [a.text[:200] for a in results]
    assert all(a.json()["usage"]["completion_tokens"] == 4 for a in results)
    assert metric(vllm.url, "kvfleet_gateway_queue_wait_seconds_count") - queued_before >= per_engine
    # and how long a request holds a slot, from vLLM's histograms over the requests finished between its scrapes
    until(lambda: all(metric(vllm.url, "kvfleet_gateway_engine_slot_seconds", endpoint=e) > 0 for e in vllm.engines),
          "the gateway never learnt how long a request holds a vLLM batch slot", timeout=10)


def test_a_conversations_turns_follow_its_cache_and_move_only_while_that_engine_is_full(vllm) -> None:
    """Multi-turn chat, each turn resending the whole conversation (as OpenAI clients do), through the routing
    `kvfleet up` runs by default: each turn goes to the engine that holds the last one's KV, and vLLM reports the
    last turn's prompt as hits there; with that engine full, the next turn goes to the other engine and is answered
    at once, and the turn after follows the conversation to where its newest KV now is."""
    c = client(vllm.url)
    messages = [{"role": "system", "content": system_prompt()}]
    turns: list[tuple[str, int, float]] = []  # (engine, the turn's prompt tokens, vLLM's hits there during it)

    def turn(question: str) -> str:
        messages.append({"role": "user", "content": question})
        hits_before = [vllm.engine_metric(k, "vllm:prefix_cache_hits_total") for k in range(2)]
        raw = c.chat.completions.with_raw_response.create(model=SERVED, messages=messages, max_tokens=8)
        answer, engine = raw.parse(), raw.headers[headers.ENGINE]
        k = vllm.engines.index(engine)
        turns.append((engine, answer.usage.prompt_tokens,
                      vllm.engine_metric(k, "vllm:prefix_cache_hits_total") - hits_before[k]))
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        wait_for_blocks(vllm.url, engine, answer.usage.prompt_tokens // BLOCK_SIZE)  # its events reached the index
        return engine

    def hit_the_last_turn() -> bool:
        """The newest turn hit at least every full block of the turn before's prompt (a prefix of its own)."""
        return turns[-1][2] >= turns[-2][1] // BLOCK_SIZE * BLOCK_SIZE > 0

    home = turn("What is a fleet?")
    assert turn("And how large can one be?") == home and hit_the_last_turn(), turns
    stop = threading.Event()
    per_engine = MAX_NUM_SEQS + SaturationPolicy().max_queue  # its batch and waiting list full: the gateway's limit
    holders = [threading.Thread(target=hold_stream, args=(home, SERVED, stop, 1800, vllm.token))
               for _ in range(per_engine)]
    try:
        for t in holders:
            t.start()
        at_home = vllm.engines.index(home)

        def home_full() -> bool:
            """vLLM runs its batch with the rest waiting, and the gateway counts one engine full (then it is home)."""
            held = tuple(vllm.engine_metric(at_home, f"vllm:num_requests_{state}") for state in ("running", "waiting"))
            return held == (MAX_NUM_SEQS, per_engine - MAX_NUM_SEQS) and \
                httpx.get(f"{vllm.url}/ready", timeout=10).json()["available"] == 1
        until(home_full, "the gateway never counted the conversation's engine full", timeout=120)
        started = time.monotonic()
        before = fleet_view(vllm)
        # a long turn: the other engine then holds full blocks of the conversation its first engine never had (a
        # short one can end in the same block, and both engines would hold the same prefix)
        away = turn("Who runs it? " + " ".join(f"Consider detail {k} of the fleet." for k in range(40)))
        # not held until the full engine has room
        assert away != home and time.monotonic() - started < 30, (turns, before, fleet_view(vllm))
    finally:
        stop.set()
        for t in holders:
            t.join()
    assert turns[-1][1] // BLOCK_SIZE > turns[-2][1] // BLOCK_SIZE, turns  # the newest KV is only where it went
    vllm.wait_idle()
    assert turn("Thanks. One more thing?") == away and hit_the_last_turn(), turns


def test_a_kvfleet_model_and_a_vllm_model_behind_one_gateway_answer_in_the_same_shapes(
        vllm, tiny_model_dir, redis_server) -> None:
    """Mixed fleets: each model its own fleet of its own runtime; the same requests give the same OpenAI shapes."""
    proc, kvfleet_engine = start_engine_server(tiny_model_dir, "--served-model-name", "tiny", "--api-key",
                                               vllm.fleet.engine_api_key)
    gateway = None
    try:
        gateway, url = start_gateway("--redis-url", redis_server.url, "--engine", f"tiny={kvfleet_engine}",
                                     *[f for e in vllm.engines for f in ("--engine", f"{SERVED}={e}")],
                                     "--engine-api-key", vllm.fleet.engine_api_key)
        shapes = {}
        for model in ("tiny", SERVED):
            plain = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                "ignore_eos": True})
            stream = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True})
            refused = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10**6})
            events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
            shapes[model] = {
                "status": (plain.status_code, stream.status_code, refused.status_code),
                "usage": sorted(k for k in plain.json()["usage"] if plain.json()["usage"][k] is not None),
                "finish": plain.json()["choices"][0]["finish_reason"],
                # vLLM adds fields of its own (system_fingerprint, ...), which OpenAI clients ignore
                "stream_end": (events[-1], sorted(CHUNK_FIELDS & set(json.loads(events[-2])))),
                "error": sorted(refused.json()["error"]),
                "content_type": stream.headers["content-type"].split(";")[0]}
        assert shapes["tiny"] == shapes[SERVED], shapes
    finally:
        if gateway is not None:
            stop_process(gateway)
        stop_process(proc)


def test_a_gateway_started_later_learns_what_vllm_cached_from_vllms_replay_socket(vllm, redis_server) -> None:
    """A gateway replica that starts (or reconnects) after vLLM cached a prompt missed its live events: it asks
    vLLM's replay socket for the buffered batches, and routes the next question under that prompt as a precise hit."""
    system = system_prompt()
    ask(vllm.engines[1], system, "First question?", auth=vllm.token)  # straight to the engine: no gateway saw it
    late, url = start_gateway("--redis-url", redis_server.url, "--engine-api-key", vllm.fleet.engine_api_key,
                              "--tokenizer", SERVED, *[f for e in vllm.engines for f in ("--engine", e)])
    try:
        assert_second_question_hits_as_predicted(vllm, url, vllm.engines[1], system)
    finally:
        stop_process(late)


def test_a_saturated_kvfleet_model_falls_back_to_a_vllm_model_and_comes_back(vllm, tiny_model_dir,
                                                                             redis_server) -> None:
    """The degradation ladder across runtimes: a kvfleet-engine model whose only engine is full lets a request that
    allows it fall back to the model vLLM serves (and the answer says so); once it has room, its own engine again."""
    proc, tiny = start_engine_server(tiny_model_dir, "--served-model-name", "tiny", "--max-num-seqs", "1",
                                     "--max-model-len", "1024", "--kv-cache-memory", "32MiB")
    gateway = None
    try:
        gateway, url = start_gateway("--redis-url", redis_server.url, "--engine", f"tiny={tiny}",
                                     *[f for e in vllm.engines for f in ("--engine", f"{SERVED}={e}")],
                                     "--engine-api-key", vllm.fleet.engine_api_key, "--fallback", f"tiny={SERVED}",
                                     "--saturation-queue", "1")
        body = {"model": "tiny", "prompt": "tell me more", "max_tokens": 4, "ignore_eos": True}
        allow = {headers.ALLOW_FALLBACK: "true", headers.PRIORITY: "standard"}
        with saturated(tiny, "tiny", (url,), served_as="tiny"):
            fell_back = httpx.post(f"{url}/v1/completions", json=body, headers=allow, timeout=120)
        assert fell_back.status_code == 200, fell_back.text
        assert fell_back.json()["model"] == SERVED and fell_back.headers[headers.DEGRADED] == f"fallback={SERVED}"
        assert fell_back.headers[headers.ENGINE] in vllm.engines
        assert fell_back.json()["usage"]["completion_tokens"] == 4
        answers = []

        def served_by_its_own_engine() -> bool:
            # a scrape that runs late on this busy machine reads as saturated for a moment (stale metrics), and the
            # request rightly falls back again: what must hold is that the model comes back once its engine has room
            answers.append(httpx.post(f"{url}/v1/completions", json=body, headers=allow, timeout=120))
            return answers[-1].json()["model"] == "tiny"
        wait_until(served_by_its_own_engine, 30, "requests never came back to the kvfleet engine once it had room")
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        assert headers.DEGRADED not in answers[-1].headers and answers[-1].headers[headers.ENGINE] == tiny
    finally:
        if gateway is not None:
            stop_process(gateway)
        stop_process(proc)


def test_a_client_that_leaves_frees_its_vllm_request_at_once_through_the_default_data_plane(vllm) -> None:
    """Issue 57: a client that leaves, streamed or not, has its request aborted in vLLM and its KV blocks freed at
    once, through the gateway `kvfleet up` runs (Envoy, the answer handed to the gateway's app to relay: its
    connection to vLLM closes when Envoy's to it does)."""
    body = {"model": SERVED, "prompt": "Count on and on:", "max_tokens": 400, "ignore_eos": True}

    def held() -> float:
        return sum(vllm.engine_metric(k, "vllm:num_requests_running") + vllm.engine_metric(
            k, "vllm:num_requests_waiting") + vllm.engine_metric(k, "vllm:kv_cache_usage_perc") for k in range(2))

    freed_in = []
    with httpx.stream("POST", f"{vllm.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        first = [next(lines), next(lines)]
        # vLLM sets its gauges in the same step as it hands out the token, and the answer went on through Envoy and
        # the gateway's relay; still, the first scrape is allowed a moment on a busy machine
        wait_until(lambda: held() > 0, 5, f"vLLM held no request while it streamed (HTTP {r.status_code}): {first}")
    left = time.monotonic()
    wait_until(lambda: held() == 0, 10, "vLLM kept a streamed request whose client left")
    freed_in.append(time.monotonic() - left)
    host, port = vllm.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # closed while vLLM generates
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
        started = time.monotonic()
        while sum(vllm.engine_metric(k, "vllm:num_requests_running") for k in range(2)) != 1:
            if time.monotonic() - started > 60:  # say what the gateway did with it instead
                sock.setblocking(False)
                try:
                    answered = sock.recv(65536)[:600]
                except BlockingIOError:
                    answered = b"(nothing yet)"
                raise AssertionError(f"the request never ran in vLLM; the gateway's /ready: "
                                     f"{httpx.get(f'{vllm.url}/ready', timeout=10).text}; it answered {answered!r}")
            time.sleep(0.1)
    left = time.monotonic()
    wait_until(lambda: held() == 0, 10, "vLLM kept a request whose client hung up")
    freed_in.append(time.monotonic() - left)
    print(f"vLLM freed a left client's request in {freed_in[0]:.2f} s (streamed), {freed_in[1]:.2f} s (not)")
    assert max(freed_in) < 3  # at once: a few of the test's 1-scrape polls on a busy machine, not a generation


def test_a_vllm_engine_that_dies_is_the_engines_failure_and_comes_back_with_the_index_starting_over(vllm) -> None:
    """Its API server killed outright: a stream it served through the Envoy data plane is finished on the other
    engine (vLLM's return_token_ids, continued from its exact token), requests go on to the other engine, the
    gateway drops the dead engine's blocks within seconds (its cache died with it), `kvfleet up` ends what the dead
    server left running (vLLM's EngineCore and workers, gigabytes of memory, orphaned by a SIGKILL to their parent
    alone), starts it again, and the gateway follows the new vLLM's events from nothing, predicting its hits exactly
    again. Runs last in this module: the restart takes vLLM's start-up time."""
    engine = vllm.engines[0]
    ask(engine, system_prompt(), "First question?", auth=vllm.token)
    wait_for_blocks(vllm.url, engine, 3)
    server = vllm.fleet.engines[0].pid
    tree = [pid for pid in group_members(server) if pid != server]
    assert tree, "vLLM's API server started no engine core"
    # two streams through a round-robin gateway of the default data plane (Envoy), one on each engine, the killed
    # one's continued on the other
    envoy_plane, envoy_url = start_gateway(*(a for e in vllm.engines for a in ("--engine", e)), "--routing",
                                             "round-robin", "--data-plane", "envoy", "--engine-api-key",
                                             vllm.fleet.engine_api_key)
    streams = [MigratingStream(envoy_url, k) for k in range(2)]
    try:
        for s in streams:
            assert s.going.wait(120), "a stream never started"
        assert sorted(s.engine for s in streams) == sorted(vllm.engines)
        os.kill(server, signal.SIGKILL)
        for s in streams:
            s.thread.join(180)
        for s in streams:  # whole: every token asked for, once, in one answer whose text is those tokens'
            assert s.done and s.finish == ["length"] and len(s.ids) == MIGRATED_TOKENS, (s.engine, s.finish, len(s.ids))
            assert s.usage["completion_tokens"] == MIGRATED_TOKENS and len(s.chunk_ids) == 1
            detokenized = httpx.post(f"{vllm.engines[1]}/detokenize", headers=vllm.token, timeout=30,
                                     json={"model": SERVED, "tokens": s.ids}).json()["prompt"]
            # a stream's text skips special tokens (which ignore_eos lets the model write); /detokenize keeps them
            assert s.text == SPECIAL_TOKEN.sub("", detokenized), (s.text, detokenized)
        migrated = [m for m in httpx.get(f"{envoy_url}/metrics", timeout=10).text.splitlines()
                    if m.startswith("kvfleet_gateway_migrations_total{") and 'outcome="continued"' in m]
        assert sum(float(m.rsplit(" ", 1)[1]) for m in migrated) >= 1, migrated
    finally:
        stop_process(envoy_plane)
    c = client(vllm.url)
    for n in range(4):  # the first may have been sent to the dead engine: the gateway retries it elsewhere
        raw = c.chat.completions.with_raw_response.create(
            model=SERVED, messages=[{"role": "user", "content": f"Still there {n}?"}], max_tokens=2)
        assert raw.parse().usage.completion_tokens > 0 and raw.headers[headers.ENGINE] == vllm.engines[1]
    wait_until(lambda: httpx.get(f"{vllm.url}/ready", timeout=10).json()["healthy"] == 1, 20,
               "the gateway still counts the dead engine healthy")
    wait_until(lambda: index_blocks(vllm.url, engine) == 0, 10, "the gateway kept the dead engine's blocks")
    wait_until(lambda: httpx.get(f"{vllm.url}/ready", timeout=10).json()["healthy"] == 2, START_TIMEOUT_S,
               "the engine did not come back")
    assert vllm.fleet.launches["engine-0"].restarts == 1 and vllm.fleet.engines[0].url == engine
    assert not [pid for pid in tree if alive(pid)], "the dead engine's EngineCore or workers still run"
    system = system_prompt()
    ask(engine, system, "First question?", auth=vllm.token)
    assert_second_question_hits_as_predicted(vllm, vllm.url, engine, system)


SPECIAL_TOKEN = re.compile(r"<\|[a-z_]+\|>")  # SmolLM2's <|im_start|>, <|im_end|>, <|endoftext|>
MIGRATED_TOKENS = 200  # seconds of decoding on one core: time to kill the engine mid-answer


class MigratingStream:
    """A long streamed chat read in a thread, with its token ids (asked for): `going` is set once tokens flow."""

    def __init__(self, url: str, k: int) -> None:
        self.url, self.k = url, k
        self.engine: str | None = None
        self.ids: list[int] = []
        self.text, self.finish, self.chunk_ids, self.usage, self.done = "", [], set(), {}, False
        self.going = threading.Event()
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def _read(self) -> None:
        body = {"model": SERVED, "messages": [{"role": "user", "content": f"Tell a long story, number {self.k}."}],
                "max_tokens": MIGRATED_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
                "return_token_ids": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=180) as r:
            self.engine = r.headers.get(headers.ENGINE)
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    self.chunk_ids.add(chunk["id"])
                    self.usage = chunk.get("usage") or self.usage
                    for choice in chunk["choices"]:
                        self.ids += choice.get("token_ids") or []
                        self.text += (choice.get("delta") or {}).get("content") or ""
                        if choice.get("finish_reason"):
                            self.finish.append(choice["finish_reason"])
                    if len(self.ids) >= 5:
                        self.going.set()
        self.going.set()




def one_stream_rate(url: str, token: dict) -> float:
    stamps = []
    with httpx.stream("POST", f"{url}/v1/completions", headers=token, timeout=120, json={
            "model": SERVED, "prompt": "Count on:", "max_tokens": 48, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.monotonic())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def test_kvfleet_bench_capacity_measures_a_vllm_engine_into_a_capacity_the_operator_takes(vllm) -> None:
    engine = vllm.engines[0]
    done = capacity_command("--url", engine, "--model", SERVED, "--max-num-seqs", str(MAX_NUM_SEQS),
                            "--api-key", vllm.fleet.engine_api_key)
    assert done.returncode == 0, done.stderr
    capacity = json.loads(done.stdout.splitlines()[0])["capacity"]
    fleet = parse_fleet("chat", "ns", {"model": SERVED, "runtime": "vllm", "autoscaling": {"capacity": capacity}})
    assert fleet.autoscaling.capacity.decode_tokens_per_s == capacity["decodeTokensPerSecond"]
    # A full batch decodes faster than one sequence alone (~4x here: 134 vs 32 tokens/s on an AMD EPYC with AVX-512
    # BF16), and prompt tokens go faster than generated ones. The two rates are measured a few seconds apart on a
    # shared machine: a CI run once caught the batch in a moment ~4x slower than the stream alone after it (31 vs 27
    # tokens/s). So a pair that misses is measured once more; a probe that does not measure a full batch (a rate
    # near one stream's) misses both times.
    pairs = [(capacity, one_stream_rate(engine, vllm.token))]
    if pairs[0][0]["decodeTokensPerSecond"] <= 1.5 * pairs[0][1]:
        again = capacity_command("--url", engine, "--model", SERVED, "--max-num-seqs", str(MAX_NUM_SEQS),
                                 "--api-key", vllm.fleet.engine_api_key)
        assert again.returncode == 0, again.stderr
        pairs.append((json.loads(again.stdout.splitlines()[0])["capacity"], one_stream_rate(engine, vllm.token)))
    assert any(c["decodeTokensPerSecond"] > 1.5 * alone for c, alone in pairs), pairs
    assert all(c["prefillTokensPerSecond"] > c["decodeTokensPerSecond"] for c, _ in pairs), pairs
