"""LoRA adapters over HTTP, as vLLM serves them: a request's `model` names the base model or an adapter,
`/v1/models` lists the adapters with their parent, and `POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter`
change them at run time (behind the engine token when one is set; loading only from --lora-allowed-dirs).

Loading reads and checks the whole adapter off the event loop before its name answers; a load that fails keeps
nothing. Unloading stops new requests for the name; requests in flight finish with it.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from kvfleet.engine.lora_adapter import AdapterError
from kvfleet.engine.lora_registry import LoraNotFoundError, LoraRegistry, LoraSpec
from kvfleet.engine.server.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from kvfleet.fleet.errors import APIError

log = logging.getLogger("kvfleet.engine")


def requested_adapter(served: str, registry: LoraRegistry | None, requested: str | None) -> LoraSpec | None:
    """The adapter a body's `model` names (None: the base model); 404 as OpenAI answers an unknown model."""
    if requested is None or requested == served:
        return None
    spec = registry.lookup(requested) if registry is not None else None
    if spec is None:
        adapters = f" or one of its {len(registry.names())} LoRA adapters (GET /v1/models)" if registry else ""
        raise APIError(404, f"The model `{requested[:200]}` does not exist; this engine serves `{served}`{adapters}",
                       param="model", code="model_not_found")
    return spec


def adapter_cards(served: str, registry: LoraRegistry | None, created: int) -> list[dict]:
    """/v1/models entries of the adapters, each with its parent (the base model), as vLLM lists them."""
    if registry is None:
        return []
    return [{"id": spec.name, "object": "model", "created": created, "owned_by": "kvfleet", "root": str(spec.path),
             "parent": served, **({"pinned": True} if registry.pinned(spec) else {})} for spec in registry.names()]


_ERROR = {"content": {"application/json": {}}}
LORA_RESPONSES: dict = {
    400: {**_ERROR, "description": "an adapter that cannot be served here, or LoRA off (the message says which)"},
    401: {**_ERROR, "description": "engine token missing or wrong (only when --api-key is set)"},
    404: {**_ERROR, "description": "no adapter of that name (unload)"},
    503: {**_ERROR, "description": "loading or draining"},
}


def install_lora_routes(app: FastAPI, state) -> None:  # noqa: ANN001 - api_server.ServerState (no cycle)
    def registry() -> LoraRegistry:
        found = state.require_engine().lora_registry
        if found is None:
            raise APIError(400, "this engine serves no LoRA adapters; start it with --enable-lora")
        return found

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=LORA_RESPONSES)
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> str:
        adapters = registry()
        if not adapters.runtime_loading:
            raise APIError(400, "loading adapters at run time is off: start the engine with --lora-allowed-dirs "
                           "naming the directories adapters may be loaded from", param="lora_path")
        try:
            spec = await asyncio.to_thread(adapters.register, body.lora_name, body.lora_path, check_allowed=True,
                                           pinned=body.pinned)
        except AdapterError as err:
            raise APIError(400, str(err), param="lora_path") from None
        log.info("loaded LoRA adapter %r from %s%s", spec.name, spec.path, " (pinned)" if body.pinned else "")
        return f"Success: LoRA adapter '{spec.name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=LORA_RESPONSES)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> str:
        try:
            spec = registry().unregister(body.lora_name)
        except LoraNotFoundError:
            raise APIError(404, f"The lora adapter '{body.lora_name[:200]}' cannot be found.", param="lora_name",
                           code="model_not_found") from None
        log.info("unloaded LoRA adapter %r", spec.name)
        return f"Success: LoRA adapter '{spec.name}' removed successfully."
