"""Turn one step's logits into next tokens, as vLLM's v1 sampler does."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvfleet.engine.sampling_params import SamplingParams

NON_FINITE_ERROR = "the model produced non-finite logits (NaN or inf) for this request"
NON_FINITE_PROBS_ERROR = ("this request's sampling parameters (repetition_penalty, temperature, logit_bias) made its "
                          "token probabilities non-finite; use values nearer the defaults")
GREEDY_BELOW = 1e-5  # temperatures this small sample greedily, as in vLLM: dividing by them overflows
BLOCK_LOGITS = 1 << 21  # logits sampled together (8 MB): their temporaries stay in cache and get reused
CANDIDATE_WIDTHS = (256, 4096)  # top-p rows look for their nucleus among this many tokens before sorting


class SamplingRow(Protocol):
    """What the sampler reads of one sequence; the engine's Sequence has these attributes."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


@dataclass
class TokenLogprobs:
    """Log-probs, from the raw logits, of the sampled token and of the most likely tokens (best first)."""

    token_logprob: float
    top: list[tuple[int, float]]


@dataclass
class SampleResult:
    """One token per row (-1 for failed rows), the failed rows' reasons, and the requested logprobs."""

    token_ids: list[int]
    errors: dict[int, str]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Samples every row of a step; rows without their own generator draw from the sampler's."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleResult:
        """Pick one next token per row of logits [num_rows, vocab]; rows with NaN or inf fail alone.

        A row whose probabilities become non-finite after its penalties and temperature fails alone too:
        it gets an error, never a token outside the vocabulary.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], got {list(logits.shape)}")
        logits = logits.float()  # the caller's tensor when already float32: never written to
        errors = {i: NON_FINITE_ERROR for i in _non_finite_rows(logits)}
        chosen = torch.full((len(rows),), -1, dtype=torch.long, device=logits.device)
        logprobs: list[TokenLogprobs | None] = []
        block_rows = max(1, BLOCK_LOGITS // max(1, logits.shape[1]))
        for start in range(0, len(rows), block_rows):
            stop = min(start + block_rows, len(rows))
            ok = [i - start for i in range(start, stop) if i not in errors]
            block = chosen[start:stop]
            self._sample_block(logits[start:stop], rows[start:stop], ok, block)
            invalid = _invalid_rows(block, ok, logits.shape[1])
            for i in invalid:
                errors[start + i] = NON_FINITE_PROBS_ERROR
                block[i] = -1
            valid = [i for i in ok if i not in invalid] if invalid else ok
            logprobs += _logprobs(logits[start:stop], block, rows[start:stop], valid)
        return SampleResult(chosen.tolist(), errors, logprobs)

    def _sample_block(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], ok: list[int], chosen: torch.Tensor
    ) -> None:
        """Write the tokens of rows ok into chosen (-1 where a row's probabilities are not finite)."""
        greedy = [i for i in ok if rows[i].sampling_params.temperature < GREEDY_BELOW]
        random = [i for i in ok if rows[i].sampling_params.temperature >= GREEDY_BELOW]
        if greedy:
            chosen[greedy] = _greedy_tokens(logits, greedy, rows)
        if random:
            chosen[random] = self._random_tokens(logits, random, rows)

    def _random_tokens(self, logits: torch.Tensor, idx: list[int], rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Rows idx after penalties, temperature, min_p, top-k and top-p, sampled by inverse CDF."""
        params = [rows[i].sampling_params for i in idx]
        sub = _penalized_rows(logits, idx, rows)
        temperatures = _column([p.temperature for p in params], logits)
        sub = sub / temperatures if sub is logits else sub.div_(temperatures)
        _drop_below_min_p(sub, [p.min_p for p in params])
        probs = sub.softmax(dim=1)
        # softmax spreads NaN over a whole row (an inf logit, or all -inf), so column 0 tells
        broken = probs[:, 0].isnan()
        uniforms = self._uniforms([rows[i] for i in idx]).to(logits.device)
        top = [j for j, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
        plain = [j for j, p in enumerate(params) if not (p.top_k > 0 or p.top_p < 1.0)]
        tokens = torch.empty(len(idx), dtype=torch.long, device=logits.device)
        if plain:
            cdf = _select(probs, plain).cumsum(dim=1)
            last = torch.full((len(plain),), cdf.shape[1] - 1, device=logits.device)
            tokens[plain] = _inverse_cdf(cdf, last, uniforms[plain])
        if top:
            vocab = logits.shape[1]
            top_k = torch.tensor([min(params[j].top_k, vocab) for j in top], device=logits.device)
            top_p = torch.tensor([params[j].top_p for j in top], device=logits.device)
            tokens[top] = _sample_top_k_top_p(_select(probs, top), top_k, top_p, uniforms[top])
        return tokens.masked_fill_(broken, -1)

    def _uniforms(self, rows: list[SamplingRow]) -> torch.Tensor:
        """One U[0, 1) draw per row; a row with its own generator draws only from it, whatever the batch."""
        uniforms = torch.rand(len(rows), generator=self.generator)
        for j, row in enumerate(rows):
            if row.generator is not None:
                uniforms[j] = torch.rand(1, generator=row.generator, device=row.generator.device).item()
        return uniforms


def _invalid_rows(chosen: torch.Tensor, ok: list[int], vocab: int) -> set[int]:
    """Rows of ok whose token is not in the vocabulary (their probabilities were not finite)."""
    if not ok:
        return set()
    picked = chosen[ok]
    bad = ((picked < 0) | (picked >= vocab)).nonzero().flatten().tolist()
    return {ok[j] for j in bad}


def _non_finite_rows(logits: torch.Tensor) -> list[int]:
    """Rows holding NaN or inf: their sum is never finite, so only rows with a non-finite sum are scanned."""
    suspects = (~torch.isfinite(logits.sum(dim=1))).nonzero().flatten().tolist()
    return [i for i in suspects if not bool(torch.isfinite(logits[i]).all())]


def _greedy_tokens(logits: torch.Tensor, idx: list[int], rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Argmax of rows idx after penalties; scanning all rows beats copying most of them out."""
    if 2 * len(idx) >= logits.shape[0] and not any(rows[i].sampling_params.has_penalties for i in idx):
        return logits.argmax(dim=1)[idx]
    return _penalized_rows(logits, idx, rows).argmax(dim=1)


def _penalized_rows(logits: torch.Tensor, idx: list[int], rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Rows idx of logits with penalties applied: a copy, or logits itself when that is all of it unchanged."""
    penalized = [j for j, i in enumerate(idx) if rows[i].sampling_params.has_penalties]
    if not penalized and len(idx) == logits.shape[0]:
        return logits
    sub = logits[idx]
    if penalized:
        _apply_penalties(sub, penalized, [rows[idx[j]] for j in penalized])
    return sub


def _apply_penalties(logits: torch.Tensor, positions: list[int], rows: Sequence[SamplingRow]) -> None:
    """Penalise rows positions of contiguous logits in place for rows' tokens: repetition, frequency, presence.

    Only the logits of tokens seen in each prompt or output are read and written.
    """
    flat = logits.view(-1)
    params = [row.sampling_params for row in rows]
    output_keys, output_rows = _token_keys([row.output_token_ids for row in rows], positions, logits)
    repetition = _vector([p.repetition_penalty for p in params], logits)
    if bool((repetition != 1.0).any()):
        prompt_keys, prompt_rows = _token_keys([row.prompt_token_ids for row in rows], positions, logits)
        keys = torch.cat([output_keys, prompt_keys])
        scale = repetition[torch.cat([output_rows, prompt_rows])]
        values = flat[keys]  # a token seen twice is written twice with the same value
        flat[keys] = torch.where(values > 0, values / scale, values * scale)
    flat.index_add_(0, output_keys, -_vector([p.frequency_penalty for p in params], logits)[output_rows])
    flat[output_keys] = flat[output_keys] - _vector([p.presence_penalty for p in params], logits)[output_rows]
    biased = [(positions[j], token, bias) for j, p in enumerate(params) for token, bias in p.logit_bias.items()
              if 0 <= token < logits.shape[1]]
    if biased:  # OpenAI's logit_bias: added to the logit after the penalties
        keys = torch.tensor([pos * logits.shape[1] + token for pos, token, _ in biased], device=logits.device)
        flat.index_add_(0, keys, _vector([bias for _, _, bias in biased], logits))


def _token_keys(
    token_lists: list[list[int]], positions: list[int], logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat logits indices (position * vocab + token) of every token, and which list each came from."""
    vocab = logits.shape[1]
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    list_of = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    inside = (tokens >= 0) & (tokens < vocab)  # ids beyond the model's vocabulary cannot be penalised
    tokens, list_of = tokens[inside], list_of[inside]
    keys = torch.tensor(positions, dtype=torch.long)[list_of] * vocab + tokens
    return keys.to(logits.device), list_of.to(logits.device)


def _drop_below_min_p(logits: torch.Tensor, min_p: list[float]) -> None:
    """Mask (in place) tokens less likely than min_p times the most likely: logit < max + log(min_p)."""
    rows = [j for j, m in enumerate(min_p) if m > 0.0]
    if not rows:
        return
    part = _select(logits, rows)
    floor = part.amax(dim=1, keepdim=True) + _column([math.log(min_p[j]) for j in rows], logits)
    part.masked_fill_(part < floor, -math.inf)
    if part is not logits:
        logits[rows] = part


def _sample_top_k_top_p(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """Sample rows restricted to top-k then top-p, sorting the whole vocabulary only for very flat rows."""
    vocab = probs.shape[1]
    tokens = torch.empty(len(probs), dtype=torch.long, device=probs.device)
    pending = torch.arange(len(probs), device=probs.device)
    for width in (*CANDIDATE_WIDTHS, vocab):
        width = max(width, int(top_k[pending].max()) + 1)
        part = probs if len(pending) == len(probs) else probs[pending]
        limits = top_k[pending], top_p[pending], uniforms[pending]
        if 4 * width >= vocab:
            tokens[pending] = _sample_nucleus(*_sorted_desc(part), *limits)[0]
            break
        sampled, fits = _sample_nucleus(*_top_candidates(part, width), *limits)
        tokens[pending[fits]] = sampled[fits]
        pending = pending[~fits]
        if len(pending) == 0:
            break
    return tokens


def _sample_nucleus(
    probs: torch.Tensor, ids: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample from sorted candidate probs; also say which rows' nucleus surely lies within the candidates."""
    width = probs.shape[1]
    cdf = probs.cumsum(dim=1)
    k = torch.where(top_k > 0, top_k.clamp(max=width), width)
    top_k_mass = cdf.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
    # top-p applies after top-k renormalises; without top-k the probs are already normalised to 1
    threshold = torch.where(top_k > 0, top_p * top_k_mass, top_p)
    threshold = torch.where(top_p < 1.0, threshold, math.inf)
    kept = torch.minimum(1 + (cdf[:, :-1] < threshold.unsqueeze(1)).sum(dim=1), k)
    # the kept prefix is the full sort's when no token left out is as likely as one kept (ties: bf16 logits)
    last_kept, last_candidate = probs.gather(1, (kept - 1).unsqueeze(1)).squeeze(1), probs[:, -1]
    fits = (last_candidate < last_kept) | (last_candidate == 0.0)
    positions = _inverse_cdf(cdf, kept - 1, uniforms)
    return ids.gather(1, positions.unsqueeze(1)).squeeze(1), fits


def _top_candidates(probs: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The width most likely tokens per row, ordered as a stable descending sort of the row would order them."""
    values, ids = probs.topk(width, dim=1)
    ids, order = ids.sort(dim=1)
    values, order = values.gather(1, order).sort(dim=1, descending=True, stable=True)
    return values, ids.gather(1, order)


def _sorted_desc(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Probs sorted descending, ties by token id, with the token ids."""
    values, ids = probs.sort(dim=1, descending=True, stable=True)
    return values, ids


def _inverse_cdf(cdf: torch.Tensor, last: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first position whose cumulative prob exceeds uniform × cdf[last]; never a zero-prob one."""
    total = cdf.gather(1, last.unsqueeze(1))
    target = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, rows: Sequence[SamplingRow], ok: list[int]
) -> list[TokenLogprobs | None]:
    """Raw logprobs (before penalties and temperature) for rows that asked for them."""
    result: list[TokenLogprobs | None] = [None] * len(rows)
    wanted = [i for i in ok if rows[i].sampling_params.logprobs is not None]
    if not wanted:
        return result
    logprobs = _select(logits, wanted).log_softmax(dim=1)
    token_logprobs = logprobs.gather(1, chosen[wanted].unsqueeze(1)).squeeze(1).tolist()
    counts = [rows[i].sampling_params.logprobs or 0 for i in wanted]
    top_values, top_ids = logprobs.topk(min(max(counts), logprobs.shape[1]), dim=1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(wanted):
        top = list(zip(top_ids[j][: counts[j]], top_values[j][: counts[j]], strict=True))
        result[i] = TokenLogprobs(token_logprobs[j], top)
    return result


def _select(tensor: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """Rows idx (increasing) of tensor: the tensor itself when that is every row, else a copy."""
    return tensor if len(idx) == tensor.shape[0] else tensor[idx]


def _vector(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """values as a float32 tensor on like's device."""
    return torch.tensor(values, dtype=torch.float32, device=like.device)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """values as a [len, 1] float32 tensor on like's device, to broadcast across the vocabulary."""
    return _vector(values, like).unsqueeze(1)
