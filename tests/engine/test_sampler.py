"""The sampler picks the tokens users expect: greedy, filtered, seeded, penalised, with logprobs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.engine import sampler as sampler_module
from kvfleet.engine.sampler import NON_FINITE_ERROR, Sampler, SampleResult
from kvfleet.engine.sampling_params import SamplingParams


@dataclass
class Row:
    """A stand-in for the engine's Sequence, with what the sampler reads."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def make_row(prompt: list[int] | None = None, output: list[int] | None = None, **params: object) -> Row:
    """A row whose generator is seeded with params' seed, as the engine does."""
    sampling_params = SamplingParams(**params)  # type: ignore[arg-type]
    generator = None
    if sampling_params.seed is not None:
        generator = torch.Generator().manual_seed(sampling_params.seed)
    return Row(sampling_params, list(prompt or []), list(output or []), generator)


def sample(logits: torch.Tensor, rows: list[Row], seed: int = 0) -> SampleResult:
    return Sampler(seed)(logits, rows)


def random_logits(rows: int, vocab: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_rows_get_the_argmax_even_beside_random_rows() -> None:
    logits = random_logits(70, 1000, seed=1)
    all_greedy = sample(logits, [make_row(temperature=0.0) for _ in range(70)])
    assert all_greedy.token_ids == logits.argmax(dim=1).tolist()
    assert all_greedy.errors == {}

    mixed_rows = [make_row(temperature=0.0 if i % 3 else 1.0) for i in range(70)]
    mixed = sample(logits, mixed_rows)
    greedy_rows = [i for i in range(70) if i % 3]
    assert [mixed.token_ids[i] for i in greedy_rows] == logits.argmax(dim=1)[greedy_rows].tolist()


def test_a_temperature_near_zero_picks_the_argmax_without_overflow() -> None:
    logits = random_logits(20, 500, seed=2, scale=10.0)
    best = logits.argmax(dim=1)
    logits[torch.arange(20), best] += 1.0  # a clear winner: at T=1e-3 the runner-up has odds e^-1000
    for temperature in (1e-3, 1e-4, 1e-9):
        rows = [make_row(temperature=temperature, seed=s) for s in range(20)]
        result = sample(logits, rows)
        assert result.errors == {}
        assert result.token_ids == best.tolist()
    huge = logits * 1000.0  # logits of 1e4 at T=1e-4 scale to 1e8: still finite
    assert sample(huge, [make_row(temperature=1e-4) for _ in range(20)]).token_ids == best.tolist()


@pytest.mark.parametrize("vocab", [500, 5000])  # the whole-vocabulary sort and the top-candidates shortcut
def test_top_k_1_is_greedy(vocab: int) -> None:
    logits = random_logits(40, vocab, seed=3)
    rows = [make_row(temperature=1.5, top_k=1, seed=s) for s in range(40)]
    assert sample(logits, rows).token_ids == logits.argmax(dim=1).tolist()


@pytest.mark.parametrize("vocab", [500, 5000])
def test_a_tiny_top_p_is_greedy(vocab: int) -> None:
    logits = random_logits(40, vocab, seed=4)
    rows = [make_row(temperature=1.0, top_p=1e-6, seed=s) for s in range(40)]
    assert sample(logits, rows).token_ids == logits.argmax(dim=1).tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_min_p_never_samples_a_token_below_its_share_of_the_best(temperature: float) -> None:
    vocab, min_p = 50, 0.1
    row_logits = torch.linspace(0.0, -6.0, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(5))]
    probs = torch.softmax(row_logits / temperature, dim=0)
    allowed = set((probs >= min_p * probs.max()).nonzero().flatten().tolist())
    rows = [make_row(temperature=temperature, min_p=min_p, seed=s) for s in range(400)]
    tokens = sample(row_logits.expand(400, vocab), rows).token_ids
    assert set(tokens) <= allowed
    assert len(set(tokens)) >= 3  # it still samples, rather than collapsing to the top token
    assert len(allowed) < vocab / 2


# logits 2, 1, 0.5, 0, -1 have probs .563 .207 .126 .076 .028; top-k and top-p keep a prefix of them
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "kept"),
    [
        (1.0, 0, 1.0, [0, 1, 2, 3, 4]),
        (0.5, 0, 1.0, [0, 1, 2, 3, 4]),
        (2.0, 0, 1.0, [0, 1, 2, 3, 4]),
        (1.0, 3, 1.0, [0, 1, 2]),
        (1.0, 0, 0.7, [0, 1]),  # .563 < .7 <= .770
        (1.0, 4, 0.8, [0, 1, 2]),  # top-4 renormalised: .579, .792 < .8 <= .921
        (1.0, 3, 0.82, [0, 1]),  # top-3 renormalised: .629 < .82 <= .860 (unrenormalised it would keep 3)
    ],
)
def test_sampling_frequencies_match_the_filtered_softmax(
    temperature: float, top_k: int, top_p: float, kept: list[int]
) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    expected = torch.zeros(5)
    expected[kept] = torch.softmax(logits[kept] / temperature, dim=0)
    draws = 6000
    rows = [make_row(temperature=temperature, top_k=top_k, top_p=top_p) for _ in range(draws)]
    tokens = torch.tensor(sample(logits.expand(draws, 5), rows, seed=11).token_ids)
    frequencies = torch.bincount(tokens, minlength=5) / draws
    assert (frequencies - expected).abs().max() < 0.025  # about 4 standard deviations


@pytest.mark.parametrize("top_p", [0.3, 0.6])  # nucleus of ~3,000 and ~6,000 tokens: past the first candidates
def test_a_wide_nucleus_is_sampled_whole_and_nothing_outside_it(top_p: float) -> None:
    vocab = 20000
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(6))
    row_logits = torch.empty(vocab)
    row_logits[order] = torch.linspace(0.0, -2.0, vocab)  # token order[r] has rank r
    sorted_probs = torch.softmax(row_logits.double(), dim=0)[order]
    nucleus_size = int(((sorted_probs.cumsum(0) - sorted_probs) < top_p).sum())
    rank = torch.empty(vocab, dtype=torch.long)
    rank[order] = torch.arange(vocab)
    rows = [make_row(top_p=top_p, seed=s) for s in range(200)]
    ranks = rank[sample(row_logits.expand(200, vocab), rows).token_ids]
    assert int(ranks.max()) <= nucleus_size  # one past the float64 boundary, for float32 rounding
    assert int(ranks.max()) > nucleus_size * 0.8  # the far end of the nucleus does get sampled


def test_a_nucleus_ending_inside_a_tie_keeps_the_lowest_token_ids() -> None:
    vocab = 5000
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))
    ranked = torch.full((vocab,), -30.0)
    ranked[:250] = -1e-3 * torch.arange(250)
    ranked[250:270] = -0.3  # 20 tied tokens across the edge of the first 256 candidates
    row_logits = torch.empty(vocab)
    row_logits[order] = ranked
    sorted_probs = torch.softmax(row_logits.double(), dim=0)[order]
    top_p = float(sorted_probs[:253].sum() + sorted_probs[253] / 2)  # the nucleus takes 4 of the tied tokens
    rows = [make_row(top_p=top_p, seed=s) for s in range(600)]
    tokens = torch.tensor(sample(row_logits.expand(600, vocab), rows).token_ids)
    tied = order[250:270]
    sampled_tied = tokens[torch.isin(tokens, tied)]
    assert len(sampled_tied) > 5
    assert torch.isin(sampled_tied, tied.sort().values[:4]).all()  # the batch cannot change which four


def run_steps(target: Row, logits_per_step: list[torch.Tensor], others: list[Row], position: int) -> list[int]:
    """Sample target at position among others over several steps, appending tokens as the engine does."""
    sampler = Sampler(seed=position)
    rows = others[:position] + [target] + others[position:]
    tokens = []
    for step, row_logits in enumerate(logits_per_step):
        logits = random_logits(len(rows), row_logits.shape[0], seed=100 + step, scale=3.0)
        logits[position] = row_logits
        result = sampler(logits, rows)
        assert result.errors == {}
        for row, token in zip(rows, result.token_ids, strict=True):
            row.output_token_ids.append(token)
        tokens.append(result.token_ids[position])
    return tokens


@pytest.mark.parametrize(
    ("params", "scale"),  # flat rows (scale 1) sort the whole vocabulary, peaked ones take the shortcut
    [
        ({"temperature": 0.8}, 1.0),
        ({"temperature": 1.0, "top_p": 0.9}, 1.0),
        ({"temperature": 1.0, "top_p": 0.9}, 6.0),
        ({"temperature": 0.7, "top_k": 50, "top_p": 0.8}, 6.0),
        ({"temperature": 1.0, "min_p": 0.05}, 1.0),
        ({"temperature": 1.0, "top_p": 0.95, "repetition_penalty": 1.3, "frequency_penalty": 0.5}, 6.0),
    ],
)
def test_a_seeded_row_gets_the_same_tokens_alone_or_in_any_batch(params: dict, scale: float) -> None:
    vocab = 5000
    logits_per_step = [random_logits(1, vocab, seed=50 + step, scale=scale)[0] for step in range(5)]
    alone = run_steps(make_row(prompt=[1, 2, 3], seed=1234, **params), logits_per_step, [], 0)

    def others() -> list[Row]:
        kinds = [
            {"temperature": 0.0, "prompt": [7]},
            {"temperature": 1.0},
            {"temperature": 0.9, "top_k": 3000, "seed": 99},  # widens the batch's top-k candidates
            {"temperature": 1.2, "top_p": 0.5, "presence_penalty": 1.0},
        ]
        return [make_row(**kinds[i % 4]) for i in range(40)]

    for position in (2, 37):
        target = make_row(prompt=[1, 2, 3], seed=1234, **params)
        with mock.patch.object(sampler_module, "BLOCK_LOGITS", 16 * vocab):  # rows 32+ in a third block
            batched = run_steps(target, logits_per_step, others(), position)
        assert batched == alone
    assert len(set(alone)) > 1


def test_a_seeded_row_with_tied_logits_gets_the_same_tokens_alone_or_in_any_batch() -> None:
    vocab = 5000
    # bf16 logits tie often; ties must not let the batch decide which of two tokens comes first
    logits_per_step = [random_logits(1, vocab, seed=60 + step, scale=4.0)[0].bfloat16().float() for step in range(8)]
    others = [make_row(temperature=0.9, top_k=3000, seed=99), make_row(top_k=1000)]
    for params in ({"top_p": 0.9}, {"top_k": 200}, {"top_k": 20, "top_p": 0.7}):
        alone = run_steps(make_row(seed=5, **params), logits_per_step, [], 0)
        assert run_steps(make_row(seed=5, **params), logits_per_step, others, 1) == alone


def test_different_seeds_give_different_tokens_and_equal_seeds_equal_ones() -> None:
    logits = random_logits(1, 1000, seed=7)

    def tokens(seed: int) -> list[int]:
        row, sampler = make_row(seed=seed), Sampler()
        return [sampler(logits, [row]).token_ids[0] for _ in range(10)]

    assert tokens(1) != tokens(2)
    assert tokens(1) == tokens(1)


def logits_with(values: dict[int, float], vocab: int = 10, rest: float = 0.0) -> torch.Tensor:
    logits = torch.full((1, vocab), rest)
    for token, value in values.items():
        logits[0, token] = value
    return logits


def greedy_token(logits: torch.Tensor, **row: object) -> int:
    return sample(logits, [make_row(temperature=0.0, **row)]).token_ids[0]  # type: ignore[arg-type]


def test_repetition_penalty_discourages_prompt_and_output_tokens() -> None:
    positive = logits_with({3: 2.0, 5: 1.8})
    assert greedy_token(positive, prompt=[3]) == 3
    assert greedy_token(positive, prompt=[3], repetition_penalty=1.5) == 5  # 2.0 / 1.5 < 1.8
    assert greedy_token(positive, output=[3], repetition_penalty=1.5) == 5
    negative = logits_with({3: -1.0, 5: -1.2}, rest=-5.0)
    assert greedy_token(negative, prompt=[3], repetition_penalty=1.5) == 5  # -1.0 * 1.5 < -1.2
    assert greedy_token(positive, prompt=[3], repetition_penalty=0.5) == 3  # below 1 encourages


def test_frequency_penalty_grows_with_the_count() -> None:
    logits = logits_with({3: 2.0, 5: 1.5})
    assert greedy_token(logits, output=[3], frequency_penalty=0.3) == 3  # 1.7 > 1.5
    assert greedy_token(logits, output=[3, 3], frequency_penalty=0.3) == 5  # 1.4 < 1.5
    assert greedy_token(logits, output=[5, 5], frequency_penalty=-0.5) == 5  # negative encourages


def test_presence_penalty_does_not_grow_with_the_count() -> None:
    logits = logits_with({3: 2.0, 5: 1.5})
    assert greedy_token(logits, output=[3] * 6, presence_penalty=0.3) == 3  # 1.7, however often
    assert greedy_token(logits, output=[3], presence_penalty=0.6) == 5


def test_frequency_and_presence_penalties_ignore_the_prompt() -> None:
    logits = logits_with({3: 2.0, 5: 1.5})
    assert greedy_token(logits, prompt=[3] * 5, frequency_penalty=2.0, presence_penalty=2.0) == 3


def test_penalties_also_shape_random_sampling_and_leave_the_callers_logits_alone() -> None:
    logits = logits_with({3: 10.0, 5: 9.0}, vocab=100).expand(64, 100)
    before = logits.clone()
    rows = [make_row(temperature=0.5, output=[3], presence_penalty=2.0, seed=s) for s in range(64)]
    tokens = sample(logits, rows).token_ids
    assert tokens.count(5) > 48  # 3 drops to 8: token 5 is e^2 = 7x likelier
    assert torch.equal(logits, before)


def test_a_row_with_non_finite_logits_fails_alone() -> None:
    logits = random_logits(6, 300, seed=8)
    logits[1, 10] = math.nan
    logits[2, 20] = math.inf
    logits[3, 30] = -math.inf
    logits[5] = 0.0
    logits[5, 42] = 3e38  # finite, though the row's sum overflows
    logits[5, 43] = 3e38
    rows = [make_row(temperature=0.0), make_row(), make_row(), make_row(), make_row(top_k=1), make_row(temperature=0)]
    result = sample(logits, rows)
    assert result.errors == {1: NON_FINITE_ERROR, 2: NON_FINITE_ERROR, 3: NON_FINITE_ERROR}
    assert "non-finite logits" in result.errors[1]
    best = logits.nan_to_num().argmax(dim=1)
    assert [result.token_ids[i] for i in (0, 4, 5)] == [int(best[0]), int(best[4]), 42]


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = random_logits(4, 100, seed=9, scale=3.0)
    rows = [
        make_row(temperature=0.5, repetition_penalty=2.0, prompt=list(range(50)), logprobs=5, seed=1),
        make_row(temperature=0.0, logprobs=0),
        make_row(temperature=0.0, logprobs=20, frequency_penalty=2.0, output=[int(logits[2].argmax())] * 10),
        make_row(temperature=1.0),
    ]
    result = sample(logits, rows)
    raw = torch.log_softmax(logits, dim=1)
    for i, count in [(0, 5), (1, 0), (2, 20)]:
        entry = result.logprobs[i]
        assert entry is not None
        assert entry.token_logprob == pytest.approx(float(raw[i, result.token_ids[i]]), abs=1e-5)
        assert len(entry.top) == count
        values = [value for _, value in entry.top]
        assert values == sorted(values, reverse=True)
        assert [token for token, _ in entry.top] == raw[i].topk(count).indices.tolist()
        assert values == pytest.approx(raw[i].topk(count).values.tolist(), abs=1e-5)
    assert result.logprobs[2].top[0][0] != result.token_ids[2]  # penalised away, yet listed as most likely
    assert result.logprobs[3] is None


@st.composite
def rows_and_logits(draw: st.DrawFn) -> tuple[torch.Tensor, list[dict]]:
    vocab = draw(st.integers(2, 60))
    num_rows = draw(st.integers(1, 5))
    # distinct logits 0.1 apart: ties would let equally likely tokens swap places between code paths
    values = draw(st.lists(st.lists(st.integers(-300, 300), min_size=vocab, max_size=vocab, unique=True),
                           min_size=num_rows, max_size=num_rows))
    params = [
        {
            "temperature": draw(st.sampled_from([0.0, 0.05, 0.5, 1.0, 2.5])),
            "top_k": draw(st.integers(0, vocab + 3)),
            "top_p": draw(st.sampled_from([1.0, 0.95, 0.5, 0.1, 1e-4])),
            "min_p": draw(st.sampled_from([0.0, 0.0, 0.05, 0.5])),
            "repetition_penalty": draw(st.sampled_from([1.0, 1.0, 1.2345])),  # makes no ties
            "seed": draw(st.integers(0, 2**32)),
        }
        for _ in range(num_rows)
    ]
    return torch.tensor(values, dtype=torch.float32) / 10, params


@settings(max_examples=100, deadline=None)
@given(case=rows_and_logits(), widths=st.sampled_from([(1, 4), (2,), (3, 9)]))
def test_sampled_tokens_are_valid_and_obey_top_k(case: tuple[torch.Tensor, list[dict]], widths: tuple) -> None:
    logits, params = case
    vocab = logits.shape[1]

    def run() -> SampleResult:
        rows = [make_row(prompt=[0, vocab - 1], **p) for p in params]
        return Sampler()(logits, rows)

    result = run()
    with mock.patch.object(sampler_module, "CANDIDATE_WIDTHS", widths):  # the shortcut, on a small vocabulary
        shortcut = run()
    assert result.errors == {}
    assert shortcut.token_ids == result.token_ids
    for row_logits, p, token in zip(logits, params, result.token_ids, strict=True):
        assert 0 <= token < vocab
        if p["top_k"] > 0 and p["repetition_penalty"] == 1.0:
            kth_largest = row_logits.sort(descending=True).values[min(p["top_k"], vocab) - 1]
            assert row_logits[token] >= kth_largest
        if p["min_p"] > 0 and p["temperature"] > 0 and p["repetition_penalty"] == 1.0:
            log_share = (row_logits[token] - row_logits.max()) / p["temperature"]
            assert log_share >= math.log(p["min_p"]) - 1e-4
