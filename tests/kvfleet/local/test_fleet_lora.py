"""`kvfleet up --lora NAME=PATH`: the README's multi-LoRA fleet. Every engine serves the adapters, the gateway lists
them, and the `openai` client gets each adapter's own answer by its name (transformers with that adapter merged by
peft), beside the base model's. A --lora that is not an adapter is refused before anything starts."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from kvfleet.engine.tokenizer import Tokenizer
from tests.conftest import free_port
from tests.support.commands import start_up
from tests.support.gateways import wait_until_routable
from tests.support.lora_adapters import make_adapter, merged_greedy

PROMPT = "The capital of France is"


def test_up_with_two_adapters_answers_each_by_its_name(smollm2_dir: Path, tmp_path: Path) -> None:
    adapters = {"sql": make_adapter(smollm2_dir, tmp_path / "sql", seed=1, std=0.06),
                "poet": make_adapter(smollm2_dir, tmp_path / "poet", seed=2, rank=32, std=0.03)}
    ids = Tokenizer(smollm2_dir).encode(PROMPT)
    expected = {name: Tokenizer(smollm2_dir).decode(merged_greedy(smollm2_dir, path, [ids], 8)[0])
                for name, path in {"smollm2-135m-instruct": None, **adapters}.items()}
    port = free_port()
    proc, lines = start_up("smollm2-135m-instruct", port, 2,
                           extra=("--lora", f"sql={adapters['sql']}", "--lora", f"poet={adapters['poet']}"))
    gateway = f"http://127.0.0.1:{port}"
    try:
        wait_until_routable(gateway, 2)
        client = OpenAI(base_url=f"{gateway}/v1", api_key="x", max_retries=0, timeout=60)
        listed = {m.id: m for m in client.models.list().data}
        assert set(listed) == {"smollm2-135m-instruct", "sql", "poet"}
        assert listed["poet"].parent == "smollm2-135m-instruct"
        for model, text in expected.items():
            reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})
            assert reply.model == model and reply.choices[0].text == text, model
        assert len(set(expected.values())) == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


@pytest.mark.parametrize(("args", "says"), [
    (["--lora", "sql"], "--lora takes NAME=PATH"),
    (["--lora", "sql=/nonexistent"], "holds no adapter_config.json"),
    (["--max-loras", "2"], "--max-loras needs --lora adapters"),
    (["--lora", "sql=.", "--model", "a", "--model", "b"], "--lora adapters belong to one base model"),
    (["--kubernetes", "--lora", "sql=/x"], "engine.extraArgs"),
])
def test_up_refuses_a_lora_that_is_not_an_adapter(args: list[str], says: str) -> None:
    r = subprocess.run([sys.executable, "-m", "kvfleet.cli", "up", *args], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and says in r.stderr, r.stderr
