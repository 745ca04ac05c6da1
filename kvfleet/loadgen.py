"""The `kvfleet bench` load generator: a seeded open-loop workload (Poisson arrivals, a priority mix, synthetic
prompts with an optional shared prefix) sent as streaming requests to a gateway or engine, one record per request."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import httpx

from kvfleet.fleet import headers as fleet_headers
from kvfleet.fleet.priority import PRIORITY_NAMES, Priority

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# Common short English words: most are one token each in a BPE vocabulary, so words ≈ tokens.
WORDS = ("the of and to in is was for on are with as at be by this from that have or one had not but what all were "
         "when we there can an your which their said if do will each about how up out them then she many some so "
         "these would other into has more her two like him see time could no make than first been its who now "
         "people my made over did down only way find use may water long little very after words called just where "
         "most know get through back much go good new write our me man too any day same right look think also "
         "around another came come work three word must because does part even place well such here take why help "
         "put different away again off went old number great tell men say small every found still between name "
         "should home big give air line set own under read last never us left end along while might next sound "
         "below saw something thought both few those always show large often together asked house world going want "
         "school important until form food keep children feet land side without boy once animal life enough took "
         "four head above kind began almost live page got earth need far hand high year mother light country father "
         "let night picture being study second soon story since white ever paper hard near sentence better best "
         "across during today however sure knew try told young sun thing whole hear example heard several change "
         "answer room sea against top turned learn point city play toward five himself usually money seen "
         "car morning river").split()


def normalize_mix(weights: dict[str, float]) -> dict[str, float]:
    """Priority weights checked (known classes, finite, non-negative, not all zero) and scaled to sum to 1."""
    if not weights:
        raise ValueError(f"the priority mix is empty; give weights for some of {PRIORITY_NAMES}")
    for name, weight in weights.items():
        if name not in {p.value for p in Priority}:
            raise ValueError(f"unknown priority class {name!r} in the priority mix; use {PRIORITY_NAMES}")
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"priority weight for {name} must be a finite number >= 0, not {weight}")
    total = sum(weights.values())
    if total <= 0:
        raise ValueError("priority weights are all zero; give at least one class a positive weight")
    ordered = [p.value for p in Priority if p.value in weights]  # critical, standard, sheddable
    return {name: weights[name] / total for name in ordered}


def parse_priority_mix(text: str) -> dict[str, float]:
    """'critical=0.2,standard=0.5,sheddable=0.3' → normalized weights; a bare class name means weight 1."""
    weights: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        if name in weights:
            raise ValueError(f"priority class {name!r} appears twice in {text!r}")
        try:
            weights[name] = float(value) if sep else 1.0
        except ValueError:
            raise ValueError(f"cannot read {value.strip()!r} as a weight in priority mix {text!r} "
                             f"(expected e.g. critical=0.2,standard=0.5,sheddable=0.3)") from None
    return normalize_mix(weights)


@dataclass
class LoadSpec:
    """What to send, where and how fast; checked on creation."""

    url: str
    num_requests: int = 100
    rate: float = math.inf  # requests per second; inf (or 0) sends them all at once
    priority_mix: dict[str, float] = field(default_factory=lambda: {"standard": 1.0})
    max_tokens: int = 64
    prompt_words: int = 64
    shared_prefix: float = 0.0  # fraction of each prompt's words that every prompt shares
    endpoint: str = "chat"
    model: str | None = None  # None: the first model the server lists
    max_queue_ms: int | None = None
    api_key: str | None = field(default=None, repr=False)
    timeout: float = 300.0
    seed: int = 0
    ignore_eos: bool = False
    allow_fallback: bool = False  # x-kvfleet-allow-fallback: true (the degradation ladder's second rung)
    models: tuple[str, ...] = ()  # each request asks for one of these (e.g. LoRA adapters); () : `model` for all
    model_zipf: float = 0.0  # their popularity: 0 uniform, s > 0 the i-th most popular weighted 1 / i**s

    def __post_init__(self) -> None:
        self.url = self.url.strip().rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, not {self.url!r}")
        if self.num_requests < 1:
            raise ValueError(f"--num-requests must be at least 1, not {self.num_requests}")
        if math.isnan(self.rate) or self.rate < 0:
            raise ValueError(f"--rate must be a number of requests per second >= 0 or 'inf', not {self.rate}")
        self.priority_mix = normalize_mix(self.priority_mix)
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, not {self.max_tokens}")
        if self.prompt_words < 1:
            raise ValueError(f"--prompt-words must be at least 1, not {self.prompt_words}")
        if not 0.0 <= self.shared_prefix <= 1.0:
            raise ValueError(f"--shared-prefix is a fraction of the prompt in [0, 1], not {self.shared_prefix}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, not {self.endpoint!r}")
        if self.max_queue_ms is not None and self.max_queue_ms <= 0:
            raise ValueError(f"--max-queue-ms must be a positive number of milliseconds, not {self.max_queue_ms}")
        if not 0.0 <= self.model_zipf <= 10.0:
            raise ValueError(f"model_zipf must be in [0, 10], not {self.model_zipf}")
        if not self.timeout > 0:
            raise ValueError(f"--timeout must be a positive number of seconds, not {self.timeout}")

    def public(self) -> dict:
        """The spec as JSON-ready data, without the API key."""
        fields = {k: v for k, v in vars(self).items() if k != "api_key"}
        return fields | {"rate": "inf" if math.isinf(self.rate) else self.rate, "api_key_set": bool(self.api_key)}


def arrival_times(n: int, rate: float, rng: random.Random) -> list[float]:
    """Send offsets in seconds for a Poisson process at `rate`/s, starting at 0; rate inf or 0: all at 0."""
    if math.isinf(rate) or rate == 0:
        return [0.0] * n
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


def assign_priorities(n: int, mix: dict[str, float], rng: random.Random) -> list[str]:
    return rng.choices(list(mix), weights=list(mix.values()), k=n)


def make_prompts(n: int, words: int, shared_prefix: float, rng: random.Random) -> list[str]:
    """`n` synthetic prompts of `words` words; the first round(words × shared_prefix) words are the same in all."""
    shared = round(words * shared_prefix)
    prefix = rng.choices(WORDS, k=shared)
    return [" ".join(prefix + rng.choices(WORDS, k=words - shared)) for _ in range(n)]


@dataclass
class PlannedRequest:
    index: int
    priority: str
    prompt: str
    send_at: float
    model: str | None = None  # one of LoadSpec.models (None: the run's model)


def plan_requests(spec: LoadSpec) -> list[PlannedRequest]:
    """The whole workload, a pure function of the spec (its seed included)."""
    rng = random.Random(spec.seed)
    times = arrival_times(spec.num_requests, spec.rate, rng)
    classes = assign_priorities(spec.num_requests, spec.priority_mix, rng)
    prompts = make_prompts(spec.num_requests, spec.prompt_words, spec.shared_prefix, rng)
    planned = [PlannedRequest(i, c, p, t) for i, (t, c, p) in enumerate(zip(times, classes, prompts, strict=True))]
    if spec.models:
        weights = [1.0 / (i + 1) ** spec.model_zipf for i in range(len(spec.models))]
        for req, model in zip(planned, rng.choices(spec.models, weights=weights, k=len(planned)), strict=True):
            req.model = model
    return planned


@dataclass
class RequestRecord:
    """What one request saw; times in seconds, `sent_at` from the start of the run."""

    index: int
    priority: str
    sent_at: float
    status: int | None = None  # None: no HTTP response (connection error, timeout)
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    engine: str | None = None
    retry_after: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


class TargetUnreachable(Exception):
    """The gateway or engine could not be reached (or named no model) before the run started."""


def _headers(spec: LoadSpec, priority: str | None = None) -> dict[str, str]:
    headers = {}
    if priority:
        headers[fleet_headers.PRIORITY] = priority
    if spec.max_queue_ms is not None:
        headers[fleet_headers.MAX_QUEUE_MS] = str(spec.max_queue_ms)
    if spec.api_key:
        headers[fleet_headers.AUTHORIZATION] = f"Bearer {spec.api_key}"
    if spec.allow_fallback:
        headers[fleet_headers.ALLOW_FALLBACK] = "true"
    return headers


async def resolve_model(client: httpx.AsyncClient, spec: LoadSpec) -> str:
    """Check that the server answers; the model to ask for: --model, or the first one GET /v1/models lists."""
    try:
        response = await client.get(f"{spec.url}/v1/models", headers=_headers(spec), timeout=min(spec.timeout, 10))
    except httpx.HTTPError as exc:
        reason = str(exc) or type(exc).__name__
        raise TargetUnreachable(f"cannot reach {spec.url} ({reason}); is the gateway or engine running there?") from exc
    if spec.model:
        return spec.model
    if response.status_code != 200:
        raise TargetUnreachable(f"{spec.url}/v1/models answered {response.status_code}; name the model with --model")
    try:
        models = [m["id"] for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        models = []
    if not models:
        raise TargetUnreachable(f"{spec.url}/v1/models lists no model; name one with --model")
    return models[0]


def _body(spec: LoadSpec, model: str, prompt: str) -> dict:
    body = {"model": model, "max_tokens": spec.max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.endpoint == "chat":
        return body | {"messages": [{"role": "user", "content": prompt}]}
    return body | {"prompt": prompt}


def _error_text(content: bytes) -> str:
    try:
        return str(json.loads(content)["error"]["message"])[:500]
    except (ValueError, KeyError, TypeError):
        return content.decode(errors="replace")[:500]


def _chunk_text(event: dict) -> str:
    choices = event.get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or choices[0].get("text") or ""


SSE_DONE = "[DONE]"  # the data of an OpenAI stream's last event


def sse_data(line: str) -> str | None:
    """The data of a server-sent event's `data:` line (an event's JSON, or SSE_DONE); None for any other line."""
    return line[5:].strip() if line.startswith("data:") else None


async def _stream(client: httpx.AsyncClient, spec: LoadSpec, model: str, req: PlannedRequest,
                  record: RequestRecord, started: float) -> None:
    """Send one request and fill `record` as its response streams in."""
    body = _body(spec, req.model or model, req.prompt)
    async with client.stream("POST", spec.url + ENDPOINTS[spec.endpoint], json=body,
                             headers=_headers(spec, req.priority)) as response:
        record.status = response.status_code
        record.engine = response.headers.get(fleet_headers.ENGINE)
        record.retry_after = response.headers.get(fleet_headers.RETRY_AFTER)
        if response.status_code != 200:
            record.error = _error_text(await response.aread())
            return
        chunks, usage_tokens, done = 0, None, False
        async for line in response.aiter_lines():
            data = sse_data(line)
            if data is None:
                continue
            if data == SSE_DONE:
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                err = event["error"]
                record.error = str(err.get("message", err) if isinstance(err, dict) else err)[:500]
            if _chunk_text(event):
                chunks += 1
                if record.ttft_s is None:
                    record.ttft_s = time.perf_counter() - started
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
        record.output_tokens = usage_tokens if usage_tokens is not None else chunks
        if not done and record.error is None:
            record.error = "the stream ended before data: [DONE]"


async def send_one(client: httpx.AsyncClient, spec: LoadSpec, model: str, req: PlannedRequest,
                   run_start: float) -> RequestRecord:
    """One request, always ending in a record: timeouts and connection errors become its error text."""
    started = time.perf_counter()
    record = RequestRecord(req.index, req.priority, started - run_start)
    try:
        async with asyncio.timeout(spec.timeout):
            await _stream(client, spec, model, req, record, started)
    except TimeoutError:
        record.error = f"timed out after {spec.timeout:g} s"
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: a chunk that is not JSON
        record.error = f"{type(exc).__name__}: {exc}"[:500]
    record.e2e_s = time.perf_counter() - started
    return record


async def run_load(spec: LoadSpec, progress: bool = True) -> list[RequestRecord]:
    """Send the planned workload at its arrival times (open loop) and return the records in request order.
    Raises TargetUnreachable before sending anything if the server does not answer."""
    from tqdm import tqdm

    plan = plan_requests(spec)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # no client-side queueing
    async with httpx.AsyncClient(timeout=httpx.Timeout(spec.timeout), limits=limits) as client:
        model = await resolve_model(client, spec)
        with tqdm(total=len(plan), unit="req", desc="bench", disable=not progress) as bar:
            run_start = time.perf_counter()
            tasks = []
            for req in plan:
                delay = run_start + req.send_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(send_one(client, spec, model, req, run_start))
                task.add_done_callback(lambda _: bar.update(1))
                tasks.append(task)
            records = await asyncio.gather(*tasks)
    return sorted(records, key=lambda r: r.index)
