"""One log line per finished request: ids, counts and timings, plain or JSON, never the prompt text."""

from __future__ import annotations

import json
import logging

from kvfleet.engine.request_log import JsonFormatter, log_finished
from kvfleet.engine.sampling_params import SamplingParams

SECRET = "my secret prompt about zebras"


def finished_output(engine):
    return engine.generate([SECRET], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]


def test_plain_line_has_counts_and_timings_but_not_the_prompt(tiny_engine, caplog) -> None:
    out = finished_output(tiny_engine)
    with caplog.at_level(logging.INFO, logger="kvfleet.requests"):
        log_finished(out)
    line = caplog.records[-1].getMessage()
    assert f"request_id={out.request_id}" in line
    assert "completion_tokens=4" in line and "finish_reason=length" in line
    assert "ttft_s=" in line and "queue_time_s=" in line and "total_s=" in line
    assert "zebras" not in line


def test_json_format_carries_the_fields(tiny_engine, caplog) -> None:
    out = finished_output(tiny_engine)
    with caplog.at_level(logging.INFO, logger="kvfleet.requests"):
        log_finished(out)
    entry = json.loads(JsonFormatter().format(caplog.records[-1]))
    assert entry["request_id"] == out.request_id
    assert entry["prompt_tokens"] == len(out.prompt_token_ids) and entry["completion_tokens"] == 4
    assert entry["total_s"] >= entry["ttft_s"] >= 0
    assert "zebras" not in json.dumps(entry)


def test_prompt_text_only_when_asked(tiny_engine, caplog) -> None:
    out = finished_output(tiny_engine)
    with caplog.at_level(logging.INFO, logger="kvfleet.requests"):
        log_finished(out, prompt_text=SECRET)
    assert SECRET in caplog.records[-1].getMessage()
    assert json.loads(JsonFormatter().format(caplog.records[-1]))["prompt"] == SECRET
