"""The `kvfleet` command as a user runs it: a chat answer from the default model, clear errors for bad flags."""

from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvfleet.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_chat_answers_a_factual_question_with_smollm2(smollm2_dir) -> None:
    result = run_cli("chat", "What is the capital of France?", "--max-tokens", "24", "--kv-cache-memory", "64MiB",
                     "--max-model-len", "512")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "KV cache: 91 blocks x 16 tokens = 1,456 tokens" in result.stderr  # capacity is logged at start


def test_kv_cache_too_small_exits_2_with_a_suggestion_and_no_traceback(smollm2_dir) -> None:
    result = run_cli("chat", "hi", "--kv-cache-memory", "8MiB")
    assert result.returncode == 2
    assert "max_model_len 8,192 does not fit in the KV cache (176 tokens); use --max-model-len 176" in result.stderr
    assert "Traceback" not in result.stderr


def test_unreadable_size_is_refused_by_the_parser() -> None:
    result = run_cli("chat", "hi", "--kv-cache-memory", "lots")
    assert result.returncode == 2
    assert "cannot read 'lots' as a size" in result.stderr


def test_unknown_model_names_the_known_ones() -> None:
    result = run_cli("chat", "hi", "--model", "no-such-model")
    assert result.returncode == 2
    assert "smollm2-135m-instruct" in result.stderr and "Traceback" not in result.stderr


def test_engine_server_that_cannot_fit_exits_2_with_a_suggestion(smollm2_dir) -> None:
    result = run_cli("engine", "--port", "0", "--host", "127.0.0.1", "--kv-cache-memory", "8MiB", timeout=120)
    assert result.returncode == 2
    assert "use --max-model-len 176" in result.stderr and "Traceback" not in result.stderr
