"""The real SmolLM2 behind `kvfleet engine`, through the `openai` client: a factual question gets a sensible answer."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai import OpenAI

from tests.conftest import start_engine_server


@pytest.fixture(scope="module")
def smollm2_client(smollm2_dir: Path):
    proc, url = start_engine_server(smollm2_dir, "--served-model-name", "smollm2-135m-instruct",
                                    "--kv-cache-memory", "64MiB", "--max-model-len", "512")
    yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    proc.terminate()
    proc.wait(timeout=30)


def test_chat_answers_the_capital_of_france(smollm2_client: OpenAI) -> None:
    out = smollm2_client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=30, temperature=0)
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason in ("stop", "length")


def test_streamed_chat_says_paris_too(smollm2_client: OpenAI) -> None:
    stream = smollm2_client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=30, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].usage.completion_tokens > 0


def test_completion_continues_a_plain_prompt(smollm2_client: OpenAI) -> None:
    out = smollm2_client.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is",
                                            max_tokens=5, temperature=0)
    assert "Paris" in out.choices[0].text
