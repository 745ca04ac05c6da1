"""Cheap checks that run before expensive work: the strict JSON body, and a prompt's length bounded in characters.

A token stands for at most `Tokenizer.max_token_chars` characters (the longest token in the vocabulary; for
byte-level BPE a token's string has one character per byte, and a character is at least one byte). So a prompt of
more than max_model_len * max_token_chars characters surely has more than max_model_len tokens, and is refused
without tokenizing it: a several-MiB prompt costs milliseconds and no memory.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.responses import Response

from kvfleet.engine.server.protocol import (
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from kvfleet.fleet.errors import APIError
from kvfleet.fleet.openai_schema import (
    SCHEMAS,
    ChatCompletionRequest,
    CompletionRequest,
    RequestSchemaError,
    parse_json,
    validate_request,
)

# Every route that reads a JSON body: the generation routes and the ones routers in front ask (vLLM's).
ENGINE_SCHEMAS = SCHEMAS | {
    "/v1/completions/render": CompletionRequest, "/v1/chat/completions/render": ChatCompletionRequest,
    "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
    "/v1/load_lora_adapter": LoadLoraAdapterRequest, "/v1/unload_lora_adapter": UnloadLoraAdapterRequest,
}


def max_prompt_chars(max_model_len: int, max_token_chars: int) -> int:
    """The longest text (in characters) that could still fit max_model_len tokens."""
    return max_model_len * max_token_chars


def check_prompt_chars(num_chars: int, max_model_len: int, max_token_chars: int, param: str) -> None:
    """Refuse text too long to fit the context whatever it says, before it is tokenized."""
    limit = max_prompt_chars(max_model_len, max_token_chars)
    if num_chars > limit:
        raise APIError(
            400, f"{param} has {num_chars} characters, more than this model's maximum context length of "
            f"{max_model_len} tokens can hold (at most {limit} characters); send a shorter prompt",
            param=param, code="context_length_exceeded")


class StrictJSONRoute(APIRoute):
    """A route whose JSON body passes the shared strict schema (depth, valid text, types) before FastAPI reads it.

    Errors become OpenAI-shaped 400s naming the field; the parsed model is left in request.state.body.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        path = self.path
        if path not in ENGINE_SCHEMAS:
            return handler

        async def strict_handler(request: Request) -> Response:
            try:
                request.state.body = validate_request(path, parse_json(await request.body()), ENGINE_SCHEMAS)
            except RequestSchemaError as err:
                raise APIError(400, err.message, param=err.param) from None
            return await handler(request)

        return strict_handler
