"""The Batch API's pure parts: each input line checked on its own, OpenAI's object shapes and bounds, and how much
batch work the fleet may take (only what interactive traffic leaves)."""

from __future__ import annotations

import json

import pytest

from kvfleet.fleet.errors import APIError
from kvfleet.gateway.batch.capacity import BatchRoom, batch_targets
from kvfleet.gateway.batch.lines import Line, LineError, read_lines
from kvfleet.gateway.batch.objects import check_metadata, list_limit, page, window_seconds
from kvfleet.gateway.routing.pick import EndpointSnapshot, SaturationPolicy

CHAT = "/v1/chat/completions"


def line(custom_id: object = "a", model: str = "m", url: str = CHAT, **body: object) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": model, "messages": [{"role": "user", "content": "hi"}], **body}}).encode()


def read(*raw: bytes) -> list[Line | LineError]:
    return list(read_lines(b"\n".join(raw), CHAT, lambda model: model == "m"))


def test_good_lines_are_read_with_their_line_numbers_and_blank_lines_skipped() -> None:
    got = read(line("a"), b"", b"   ", line("b", max_tokens=3))
    assert [(g.number, g.custom_id) for g in got] == [(1, "a"), (4, "b")] and all(isinstance(g, Line) for g in got)
    assert got[1].body["max_tokens"] == 3


@pytest.mark.parametrize(("raw", "code"), [
    (b"{oops", "invalid_json"),
    (b"[1, 2]", "invalid_request"),
    (b"[" * 10_000, "invalid_json"),  # nesting past the parser's depth
    (line(custom_id=7), "invalid_custom_id"),
    (line(custom_id=""), "invalid_custom_id"),
    (line(custom_id="x" * 513), "invalid_custom_id"),
    (line(url="/v1/completions"), "mismatched_endpoint"),
    (line(model="other"), "model_not_found"),
    (line(stream=True), "invalid_body"),
    (line(max_tokens="ten"), "invalid_body"),
    (line(temperature="hot"), "invalid_body"),
    (json.dumps({"custom_id": "a", "method": "GET", "url": CHAT, "body": {}}).encode(), "invalid_method"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": "text"}).encode(), "invalid_body"),
])
def test_each_bad_line_is_its_own_error_naming_its_line(raw: bytes, code: str) -> None:
    good, bad = read(line("ok"), raw)
    assert isinstance(good, Line) and isinstance(bad, LineError)
    assert bad.code == code and bad.number == 2 and bad.message.startswith("line 2:")


def test_a_custom_id_seen_before_is_an_error_and_the_first_runs() -> None:
    first, again, other = read(line("a"), line("a"), line("b"))
    assert isinstance(first, Line) and isinstance(other, Line)
    assert isinstance(again, LineError) and again.code == "duplicate_custom_id" and again.custom_id == "a"


@pytest.mark.parametrize(("window", "seconds"), [("24h", 86400), ("1m", 60), ("90m", 5400), ("168h", 604800)])
def test_completion_windows(window: str, seconds: int) -> None:
    assert window_seconds(window) == seconds


@pytest.mark.parametrize("window", ["2d", "0h", "169h", "24", "", None, 24, "1h30m", "-1h", "99999h"])
def test_a_bad_completion_window_says_what_to_write(window: object) -> None:
    with pytest.raises(APIError, match="24h"):
        window_seconds(window)


@pytest.mark.parametrize("metadata", [{"k": 1}, {"k" * 65: "v"}, {"k": "v" * 513}, ["k"],
                                      {str(i): "v" for i in range(17)}])
def test_bad_metadata_is_refused(metadata: object) -> None:
    with pytest.raises(APIError, match="metadata"):
        check_metadata(metadata)


def test_pages_follow_after_and_limit() -> None:
    items = [{"id": f"x{i}"} for i in range(5)]
    first = page(items, None, 2)
    assert [i["id"] for i in first["data"]] == ["x0", "x1"] and first["has_more"] and first["last_id"] == "x1"
    last = page(items, "x3", 2)
    assert [i["id"] for i in last["data"]] == ["x4"] and not last["has_more"]
    with pytest.raises(APIError, match="after"):
        page(items, "nope", 2)
    for bad in ("0", "101", "ten"):
        with pytest.raises(APIError, match="limit"):
            list_limit(bad)


def engine(url: str, running: int = 0, waiting: int = 0, max_num_seqs: int | None = 8, kv: float = 0.1,
           in_flight: int = 0) -> EndpointSnapshot:
    return EndpointSnapshot(url, True, kv, waiting, running, 0.0, in_flight=in_flight, max_num_seqs=max_num_seqs)


POLICY = SaturationPolicy()


def test_batch_work_takes_only_free_slots_less_a_reserve() -> None:
    room = BatchRoom(reserve_fraction=0.25, share=1.0)
    assert batch_targets([engine("idle"), engine("busy", running=5)], 0, {}, POLICY, room) == {"idle": 6, "busy": 1}
    # its own requests in flight count against the room until the scrape shows them
    assert batch_targets([engine("idle")], 0, {"idle": 4}, POLICY, room) == {"idle": 2}
    assert batch_targets([engine("idle", in_flight=6)], 0, {}, POLICY, room) == {}


def test_batch_work_holds_at_most_its_share_of_an_engines_slots() -> None:
    room = BatchRoom(reserve_fraction=0.25, share=0.25)
    assert batch_targets([engine("idle")], 0, {}, POLICY, room) == {"idle": 2}  # 8 slots x 0.25
    assert batch_targets([engine("idle", running=1)], 0, {"idle": 1}, POLICY, room) == {"idle": 1}
    assert batch_targets([engine("idle", running=2)], 0, {"idle": 2}, POLICY, room) == {}


def test_no_batch_work_while_interactive_requests_wait_or_where_an_engine_is_saturated() -> None:
    room = BatchRoom()
    assert batch_targets([engine("a")], 1, {}, POLICY, room) == {}
    assert batch_targets([engine("full-kv", kv=0.9), engine("queue", waiting=5)], 0, {}, POLICY, room) == {}


def test_an_engine_that_does_not_say_its_batch_size_takes_one_at_a_time() -> None:
    assert batch_targets([engine("vllm", max_num_seqs=None)], 0, {}, POLICY, BatchRoom()) == {"vllm": 1}
    assert batch_targets([engine("vllm", max_num_seqs=None)], 0, {"vllm": 1}, POLICY, BatchRoom()) == {}
