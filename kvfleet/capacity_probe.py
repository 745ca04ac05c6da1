"""`kvfleet bench capacity`: one engine's capacity measured from outside, for an InferenceFleet whose pods do not
report their own (vLLM): its prefill tokens/s and its decode tokens/s with a full batch, the two rates the SLO
planner sizes a fleet with (spec.autoscaling.capacity). Dynamo's planner starts from such a profile too.

Prefill: two prompts of different lengths, each answered with one token, several times with a fresh prefix so no
prefix cache helps; the rate is the extra prompt tokens over the extra time (the fixed cost of a request cancels).
Decode: max_num_seqs streams at once, each with a short prompt and a long answer; the rate is the tokens all streams
received while every one of them was decoding (after the last first token, before the first last token)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx

from kvfleet.loadgen import SSE_DONE, WORDS, sse_data
from kvfleet.operator.fleet_spec import capacity_spec
from kvfleet.operator.planner import Capacity

PROMPT_WORDS = (32, 512)  # the short and the long prompt of the prefill probe
TRIES = 3  # each prompt's fastest of this many answers counts
DECODE_TOKENS = 96  # each stream's answer in the decode probe


def text(words: int, rng: random.Random) -> str:
    """About `words` tokens, starting with a random number: no two prompts share a cached prefix."""
    return f"{rng.randint(0, 10**12)} " + " ".join(rng.choice(WORDS) for _ in range(words))


def full_batch_rate(streams: list[list[float]]) -> float:
    """Tokens per second over the window where every stream was decoding: from the last stream's first token to
    the first stream's last token (token arrival times in seconds, one list per stream)."""
    streams = [s for s in streams if len(s) > 1]
    if not streams:
        raise ValueError("no stream returned more than one token: the engine cannot be measured")
    start, end = max(s[0] for s in streams), min(s[-1] for s in streams)
    if end <= start:
        raise ValueError("the streams never decoded together: give a larger --max-num-seqs window or longer answers")
    tokens = sum(sum(1 for t in s if start < t <= end) for s in streams)
    return tokens / (end - start)


def prefill_rate(short: tuple[int, float], long: tuple[int, float]) -> float:
    """(prompt tokens, seconds to answer one token) of a short and a long prompt → prompt tokens per second."""
    (n_short, t_short), (n_long, t_long) = short, long
    if n_long <= n_short or t_long <= t_short:
        raise ValueError(f"the long prompt ({n_long} tokens, {t_long:.3f} s) was not slower than the short one "
                         f"({n_short} tokens, {t_short:.3f} s): the engine is busy with other work; measure it idle")
    return (n_long - n_short) / (t_long - t_short)


async def _one_token(http: httpx.AsyncClient, url: str, model: str, words: int,
                     rng: random.Random) -> tuple[int, float]:
    t0 = time.monotonic()
    r = await http.post(f"{url}/v1/completions", json={"model": model, "prompt": text(words, rng), "max_tokens": 1,
                                                       "temperature": 0.0})
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens"], time.monotonic() - t0


async def _stream(http: httpx.AsyncClient, url: str, model: str, rng: random.Random, t0: float) -> list[float]:
    stamps = []
    body = {"model": model, "prompt": text(16, rng), "max_tokens": DECODE_TOKENS, "ignore_eos": True,
            "temperature": 0.0, "stream": True}
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            data = sse_data(line)
            if data not in (None, SSE_DONE) and any(c.get("text") for c in json.loads(data).get("choices") or []):
                stamps.append(time.monotonic() - t0)
    return stamps


async def probe(url: str, model: str, max_num_seqs: int, api_key: str | None = None,
                timeout_s: float = 600.0, seed: int = 0) -> Capacity:
    """Measure an idle engine (or a gateway in front of exactly one idle engine)."""
    if max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be at least 1, not {max_num_seqs}")
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_num_seqs + 4)
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers, limits=limits) as http:
        await _one_token(http, url, model, PROMPT_WORDS[0], rng)  # warm-up: the first request pays for compiles
        timed = {}
        for words in PROMPT_WORDS:
            runs = [await _one_token(http, url, model, words, rng) for _ in range(TRIES)]
            timed[words] = (max(n for n, _ in runs), min(t for _, t in runs))
        t0 = time.monotonic()
        streams = await asyncio.gather(*(_stream(http, url, model, rng, t0) for _ in range(max_num_seqs)))
    return Capacity(prefill_rate(timed[PROMPT_WORDS[0]], timed[PROMPT_WORDS[1]]), full_batch_rate(list(streams)))


def main(argv: list[str]) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="kvfleet bench capacity", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the engine's base URL (idle, alone), e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the model name the engine serves")
    p.add_argument("--max-num-seqs", type=int, required=True, help="the engine's batch size (vLLM's --max-num-seqs)")
    p.add_argument("--api-key", help="the engine's token, if it asks for one")
    args = p.parse_args(argv)
    try:
        measured = asyncio.run(probe(args.url.rstrip("/"), args.model, args.max_num_seqs, args.api_key))
    except (ValueError, httpx.HTTPError) as err:
        print(f"kvfleet bench capacity: {err}", file=sys.stderr)
        return 2
    spec = capacity_spec(measured)
    print(json.dumps({"capacity": spec, "max_num_seqs": args.max_num_seqs}))
    print(f"# spec.autoscaling of the InferenceFleet (engine.maxNumSeqs {args.max_num_seqs}):\ncapacity:\n"
          + "".join(f"  {k}: {v}\n" for k, v in spec.items()), end="")
    return 0
