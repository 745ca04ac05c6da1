"""What a gateway reads to estimate a new request's time to first token: the prompt tokens an engine has yet to
compute (kvfleet_prefill_tokens_pending) and the rate its steps compute them at (kvfleet_prefill_tokens_per_second)."""

from __future__ import annotations

from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.fleet import metrics as names
from kvfleet.fleet.load import parse_engine_load
from tests.conftest import make_engine


def test_pending_prompt_tokens_drain_as_steps_compute_them_and_the_rate_is_measured(tiny_model_dir) -> None:
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=64)
    assert engine.stats().prefill_tokens_pending == 0 and engine.stats().prefill_tokens_per_second == 0.0
    for i in range(3):
        engine.add_request(f"r{i}", list(range(100 * i + 1, 100 * i + 101)), SamplingParams(max_tokens=2))
    assert engine.stats().prefill_tokens_pending == 300
    engine.step()  # 64 tokens of the first prompt: a chunk
    assert engine.stats().prefill_tokens_pending == 236
    assert engine.stats().prefill_tokens_per_second > 0
    while engine.stats().prefill_tokens_pending:
        engine.step()
    assert engine.has_unfinished_requests()


def test_the_gateway_reads_both_from_the_engines_metrics(tiny_model_dir) -> None:
    from kvfleet.engine.metrics import EngineMetrics

    engine = make_engine(tiny_model_dir)
    engine.add_request("r", list(range(1, 81)), SamplingParams(max_tokens=2))
    text = EngineMetrics(engine.stats).render([names.PREFILL_TOKENS_PENDING, names.PREFILL_TOKENS_PER_SECOND,
                                              names.KV_CACHE_USAGE, names.NUM_REQUESTS_RUNNING,
                                              names.NUM_REQUESTS_WAITING]).decode()
    load = parse_engine_load(text)
    assert load.prefill_tokens_pending == 80 and load.prefill_tokens_per_second is None
    engine.step()
    load = parse_engine_load(EngineMetrics(engine.stats).render().decode())
    assert load.prefill_tokens_pending == 0 and load.prefill_tokens_per_second > 0


def test_short_prefills_leave_the_rate_measured_on_long_ones(tiny_model_dir) -> None:
    """A prefill of a few tokens (a prompt mostly in the prefix cache) is its step's fixed cost and any stall of the
    process, not the engine's rate: measured, it made the holder of a hot prefix read several times slower than it
    is, and prefix-aware routing sent the prefix's tenants away from their cache (a fresh-clone run with engines
    given more threads than cores)."""
    engine = make_engine(tiny_model_dir)
    engine.add_request("long", list(range(1, 201)), SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    measured = engine.stats().prefill_tokens_per_second
    assert measured > 0
    for i in range(4):  # the same prompt and a few new tokens: only those are computed
        engine.add_request(f"hit{i}", [*range(1, 201), *range(1000 + 10 * i, 1010 + 10 * i)],
                           SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.stats().prefill_tokens_per_second == measured
