"""Request migration, after NVIDIA Dynamo's: an answer its engine ended without the model's own end (the connection
dropped, the stream stopped without [DONE], a choice finished `abort`) is continued on another engine from its exact
token, spliced into the client's stream. Pure: the proxy keeps the events it relayed, asks here what to send next and
how to rewrite what comes back.

The continuation is a completion whose prompt is the answer's prompt token ids plus the ids generated so far (the
engines return both: vLLM's `return_token_ids`, which the gateway asks for), with the tokens left and the same
sampling settings (a seed advanced by the tokens generated, so a sampled answer does not repeat itself). Its events
are rewritten into the client's answer: the same id, created, model and choice index, chat deltas for a chat, text
offsets and usage counting the whole answer once. Greedy decoding continues exactly as the undisturbed answer would;
presence and frequency penalties see the earlier tokens as prompt, not output, so a penalised answer may differ.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from kvfleet.fleet.openai_schema import COMPLETIONS_DEFAULT_MAX_TOKENS

DEFAULT_MIGRATION_LIMIT = 3  # continuations per request, as Dynamo's --migration-limit (0: off)
MAX_KEPT_BYTES = 4 * 1024 * 1024  # of a stream's events kept to continue it from; past it, it is not migrated
ABORTED = re.compile(rb'"finish_reason":\s*"abort"')
_EVENT_END = re.compile(rb"\r?\n\r?\n")
_TOKEN_IDS = re.compile(rb',\s*"(?:prompt_)?token_ids":\s*(?:\[[0-9,\s]*\]|null)')
# what a completion continuing the answer keeps of the request: the sampling settings, nothing of its shape
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "stop", "stop_token_ids", "ignore_eos", "logit_bias", "skip_special_tokens", "include_stop_str_in_output",
            "priority", "user")


# what a continuation (a plain completion of token ids) cannot carry on: a tool parser's or a grammar's state
NOT_CONTINUABLE = ("tools", "functions", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                   "structured_outputs")


def continuable_body(body: dict) -> bool:
    """Whether an answer to this request can be continued on another engine: a stream of one choice of one prompt,
    without tools or a constrained output (a continuation would restart their parser or grammar)."""
    prompt = body.get("prompt")
    one_prompt = not isinstance(prompt, list) or not prompt or isinstance(prompt[0], int)
    form = body.get("response_format")
    plain = not any(body.get(k) for k in NOT_CONTINUABLE) and (
        form is None or isinstance(form, dict) and form.get("type") == "text")
    return (body.get("stream") is True and body.get("n", 1) == 1 and body.get("best_of") in (None, 1) and one_prompt
            and plain)


def strip_token_ids(event: bytes) -> bytes:
    """An SSE event without the token-id fields the gateway asked for and the client did not."""
    return _TOKEN_IDS.sub(b"", event) if b"token_ids" in event else event


@dataclass
class Progress:
    """What the client has of one choice: its prompt's token ids, the ids and text generated, how it finished."""

    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


@dataclass
class Answer:
    """A streamed answer as the client has received it so far."""

    id: str | None = None
    created: int | None = None
    model: str | None = None
    object: str | None = None
    choices: dict[int, Progress] = field(default_factory=dict)
    migrations: int = 0
    generated_before: dict[int, int] = field(default_factory=dict)  # per choice: tokens before the continuation

    def read(self, events: list[bytes]) -> None:
        """Takes in the SSE events the client was sent (with the engine's token ids), in order."""
        for event in events:
            chunk = _chunk(event)
            if chunk is None:
                continue
            if self.id is None:
                self.id, self.created, self.model = chunk.get("id"), chunk.get("created"), chunk.get("model")
                self.object = chunk.get("object")
            top_prompt = chunk.get("prompt_token_ids")
            for choice in chunk.get("choices") or []:
                if not isinstance(choice, dict) or not isinstance(choice.get("index"), int):
                    continue
                progress = self.choices.setdefault(choice["index"], Progress())
                prompt = choice.get("prompt_token_ids") or top_prompt
                if progress.prompt_ids is None and isinstance(prompt, list):
                    progress.prompt_ids = [t for t in prompt if isinstance(t, int)]
                ids = choice.get("token_ids")
                if isinstance(ids, list):
                    progress.generated += [t for t in ids if isinstance(t, int)]
                delta = choice.get("delta")
                text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                if isinstance(text, str):
                    progress.text += text
                if choice.get("finish_reason") is not None:
                    progress.finish_reason = choice["finish_reason"]

    @property
    def chat(self) -> bool:
        return self.object == "chat.completion.chunk"

    def unfinished(self) -> list[int]:
        """The choices the model did not end: still open, or ended `abort` by their engine."""
        return sorted(i for i, p in self.choices.items() if p.finish_reason in (None, "abort"))

    def continuation(self, body: dict, index: int) -> dict | None:
        """The completion that continues choice `index` of the request `body` (as the engines were sent it), or
        None when it cannot be continued: no token ids came, or several prompts or choices share the stream."""
        progress = self.choices.get(index)
        if progress is None or progress.prompt_ids is None or body.get("n", 1) != 1 or \
                isinstance(body.get("prompt"), list) and body["prompt"] and not isinstance(body["prompt"][0], int):
            return None
        limit = body.get("max_completion_tokens") if self.chat else None
        limit = limit if limit is not None else body.get("max_tokens")
        if limit is None and not self.chat:
            limit = COMPLETIONS_DEFAULT_MAX_TOKENS
        out = {k: body[k] for k in SAMPLING if k in body}
        out.update(model=body.get("model"), prompt=progress.prompt_ids + progress.generated, stream=True,
                   return_token_ids=True)
        if "stream_options" in body:  # its usage chunk, where the answer's was asked for (and hidden if so)
            out["stream_options"] = body["stream_options"]
        if limit is not None:
            left = limit - len(progress.generated)
            if left <= 0:
                return None
            out["max_tokens"] = left
        if isinstance(body.get("seed"), int):
            out["seed"] = (body["seed"] + len(progress.generated)) % 2**64
        logprobs = (body.get("top_logprobs") or 0) if body.get("logprobs") is True else body.get("logprobs")
        if isinstance(logprobs, int) and not isinstance(logprobs, bool):
            out["logprobs"] = logprobs
        self.generated_before[index] = len(progress.generated)
        return out

    def splice(self, event: bytes, index: int, keep_token_ids: bool) -> bytes | None:
        """A continuation's SSE event rewritten into the client's answer (None: nothing to pass on)."""
        chunk = _chunk(event)
        if chunk is None:
            return None
        out: dict = {"id": self.id, "object": self.object, "created": self.created, "model": self.model}
        usage = chunk.get("usage")
        choices = chunk.get("choices") or []
        if not choices and isinstance(usage, dict):  # the usage chunk: the whole answer counted once
            progress = self.choices[index]
            prompt = len(progress.prompt_ids or [])
            completion = self.generated_before.get(index, 0) + int(usage.get("completion_tokens") or 0)
            out.update(choices=[], usage={"prompt_tokens": prompt, "completion_tokens": completion,
                                          "total_tokens": prompt + completion})
            return _event(out)
        spliced = []
        for choice in choices:
            text = choice.get("text") or ""
            new: dict = {"index": index}
            if self.chat:
                new["delta"] = {"content": text} if text or choice.get("finish_reason") is None else {}
                new["logprobs"] = _chat_logprobs(choice.get("logprobs"))
            else:
                new["text"] = text
                new["logprobs"] = _offset(choice.get("logprobs"), len(self.choices[index].text))
            new["finish_reason"] = choice.get("finish_reason")
            if keep_token_ids and isinstance(choice.get("token_ids"), list):
                new["token_ids"] = choice["token_ids"]
            spliced.append(new)
        out["choices"] = spliced
        return _event(out)


def _chunk(event: bytes) -> dict | None:
    if not event.startswith(b"data: {"):
        return None
    try:
        chunk = json.loads(event[len(b"data: "):])
    except ValueError:
        return None
    return chunk if isinstance(chunk, dict) and "error" not in chunk else None


def _event(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def _offset(logprobs: object, by: int) -> object:
    """A completion's logprobs, its text offsets moved past the text the client already has."""
    if isinstance(logprobs, dict) and isinstance(logprobs.get("text_offset"), list):
        return {**logprobs, "text_offset": [o + by for o in logprobs["text_offset"] if isinstance(o, int)]}
    return logprobs


def _chat_logprobs(logprobs: object) -> dict | None:
    """A completion's logprobs (tokens, token_logprobs, top_logprobs) in a chat's shape (content entries)."""
    if not isinstance(logprobs, dict) or not isinstance(logprobs.get("tokens"), list):
        return None
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs["tokens"])

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(k, v) for k, v in (top or {}).items()]}
                        for t, lp, top in zip(logprobs["tokens"], logprobs.get("token_logprobs") or [], tops,
                                              strict=False)]}


class Relayed:
    """One streamed answer as the proxy relays it, engine after engine: each event passed on (token ids taken out
    unless the client asked for them), held back (an `abort` finish and what follows it; [DONE] until the answer is
    whole) or kept to continue from (at most MAX_KEPT_BYTES), and the next engine's request when one is needed."""

    def __init__(self, body: bytes, hide_token_ids: bool, limit: int = DEFAULT_MIGRATION_LIMIT) -> None:
        self.body, self.hide_token_ids, self.limit = body, hide_token_ids, limit
        self.kept: list[bytes] | None = []
        self.kept_bytes = 0
        self.aborted = self.done = False
        self.answer: Answer | None = None  # once it moved to another engine: the answer so far, spliced into
        self.index = 0  # the choice continued

    @property
    def migrations(self) -> int:
        return self.answer.migrations if self.answer is not None else 0

    def take(self, event: bytes) -> bytes | None:
        """What to pass on to the client of this engine's event; None: nothing (yet)."""
        if event.startswith(b"data: [DONE]"):
            self.done = True
            return None
        if self.aborted:  # the usage of an aborted answer, or anything else after it: the answer goes on elsewhere
            return None
        aborted = ABORTED.search(event) is not None
        if self.answer is not None:  # a continuation's event, in the client's answer's shape
            spliced = self.answer.splice(event, self.index, keep_token_ids=True)
            if spliced is None:
                return None
            self.answer.read([spliced])
            event = spliced
        else:
            self._keep(event)
        if aborted:  # its tokens are kept, its finish is not the client's: the answer goes on elsewhere
            self.aborted = True
            return None
        return strip_token_ids(event) if self.hide_token_ids else event

    def whole(self) -> bool:
        """Whether the engine ended the answer as the model did: [DONE], and no choice aborted."""
        return self.done and not self.aborted

    def next_request(self) -> dict | None:
        """The completion that continues the answer on another engine (its state reset for that engine's events),
        or None: over the limit, too long to have kept, several choices, no token ids, nothing left to generate."""
        if self.migrations >= self.limit:
            return None
        if self.answer is None:
            if self.kept is None:
                return None
            self.answer = Answer()
            self.answer.read(self.kept)
            self.kept = None
        unfinished = self.answer.unfinished()
        if len(unfinished) != 1 or len(self.answer.choices) != 1:
            return None
        self.index = unfinished[0]
        follow = self.answer.continuation(json.loads(self.body), self.index)
        if follow is not None:
            self.answer.migrations += 1
            self.aborted = self.done = False
        return follow

    def _keep(self, event: bytes) -> None:
        if self.kept is None:
            return
        self.kept_bytes += len(event)
        if self.kept_bytes > MAX_KEPT_BYTES:
            self.kept = None  # too long an answer to continue: it ends as before if its engine drops it
        else:
            self.kept.append(event)


class Events:
    """An SSE byte stream cut into whole events (each with its blank line), whatever the chunks' boundaries."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._pending + chunk
        out, start = [], 0
        for end in _EVENT_END.finditer(data):
            out.append(data[start:end.end()])
            start = end.end()
        self._pending = data[start:]
        return out

    def finish(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest
