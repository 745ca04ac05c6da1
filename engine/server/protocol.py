"""Request bodies (the strict shared schema in kvfleet.fleet.openai_schema) checked against this model, and mapped onto
SamplingParams."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.fleet.openai_schema import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Int64,
    RequestSchemaError,
    SamplingRequest,
    StreamOptions,
)

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "DetokenizeRequest", "LoadLoraAdapterRequest",
           "RequestSchemaError", "SamplingRequest", "StreamOptions", "TokenizeRequest", "UnloadLoraAdapterRequest",
           "check_against_model", "sampling_params"]

MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
MAX_CHOICES = 128  # prompts x n in one request: each is an engine request


def check_against_model(body: SamplingRequest, vocab_size: int, num_prompts: int = 1) -> None:
    """Refuse fields valid in type but impossible for this model; RequestSchemaError names the field."""
    if body.top_k is not None and body.top_k not in (-1, 0) and not 1 <= body.top_k <= vocab_size:
        raise RequestSchemaError(f"top_k must be -1 (no limit) or in [1, {vocab_size}] (the vocabulary), "
                                 f"got {body.top_k}", "top_k")
    for i, token_id in enumerate(body.stop_token_ids or []):
        if not 0 <= token_id < vocab_size:
            raise RequestSchemaError(f"stop_token_ids[{i}] must be a token id in [0, {vocab_size}), got {token_id}",
                                     f"stop_token_ids.{i}")
    bias = body.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise RequestSchemaError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(bias)}",
                                 "logit_bias")
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or not 0 <= int(key) < vocab_size:  # '¹'.isdigit() too
            raise RequestSchemaError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key[:32]!r}",
                                     "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise RequestSchemaError(f"logit_bias values must be in [-100, 100], got {value} for token {key}",
                                     "logit_bias")
    if body.return_hidden_states:
        raise RequestSchemaError("return_hidden_states: this engine does not return hidden states; send false or "
                                 "leave it out", "return_hidden_states")
    if 1 <= body.n <= MAX_CHOICES < num_prompts * body.n:
        raise RequestSchemaError(f"prompts x n must be at most {MAX_CHOICES}, got {num_prompts} x {body.n}", "n")


def sampling_params(body: SamplingRequest, max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    """SamplingParams for this body; RequestSchemaError names the field that is out of range."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p,
            seed=body.seed,
            stop=body.stop_list(),
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logprobs=logprobs,
            n=body.n,
            logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output or body.no_stop_trim,
        )
    except ValueError as err:  # SamplingParams' messages start with the field's name
        message = str(err)
        field = message.split(" ", 1)[0].removesuffix("[]")
        raise RequestSchemaError(message, field if field in SamplingRequest.model_fields or field in (
            "max_tokens", "logprobs") else None) from err


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter: a name for the adapter and its directory (load_inplace and other vLLM
    fields are accepted and ignored)."""

    model_config = ConfigDict(extra="allow", strict=True)

    lora_name: StrictStr = Field(max_length=256)
    lora_path: StrictStr = Field(max_length=4096)
    # kvfleet's: keep its weights in host memory, never evicted (the operator pins an InferenceFleet's pinned ones)
    pinned: StrictBool = False


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's POST /v1/unload_lora_adapter."""

    model_config = ConfigDict(extra="allow", strict=True)

    lora_name: StrictStr = Field(max_length=256)


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a prompt, or chat messages rendered with the model's template (exactly one)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool = True  # for a prompt; a chat template writes its own
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    """vLLM's POST /detokenize."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: StrictStr | None = None
    tokens: list[Int64]
