"""The OpenAI Files and Batches API on the gateway (the `openai` client's `files.*` and `batches.*` calls, unchanged).

A caller is its API key's tenant (without keys, its x-kvfleet-tenant header, else the default tenant), and sees only
its own files and batches: another tenant's id is answered as one that does not exist. Uploads are bounded in bytes
(413) and lines, and a tenant's unfinished batches are capped (429), so a flood of uploads or tiny batches costs
the flooder, not the fleet.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from kvfleet.fleet import headers
from kvfleet.fleet.errors import APIError
from kvfleet.fleet.openai_schema import RequestSchemaError, check_json_value, parse_json
from kvfleet.gateway.batch.files import FileStore, new_batch_id, new_file_id
from kvfleet.gateway.batch.lines import ENDPOINTS, file_tokens
from kvfleet.gateway.batch.objects import (
    FINISHED,
    RUNNING,
    check_metadata,
    expiry_seconds,
    list_limit,
    page,
    public_batch,
    window_seconds,
)
from kvfleet.gateway.batch.settings import BatchSettings
from kvfleet.gateway.batch.state import BatchState, FileRecord

MAX_FILENAME = 256
T = TypeVar("T")
log = logging.getLogger("kvfleet.gateway.batch")


def not_found(kind: str, given: str) -> APIError:
    return APIError(404, f"No {kind} with id {given[:80]!r} found", code="not_found", param="id")


class BatchService:
    def __init__(self, state: BatchState, files: FileStore, limits: BatchSettings,
                 tenant_of: Callable[[Mapping[str, str]], str], wake: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.time,
                 token_limit_of: Callable[[Mapping[str, str]], int | None] | None = None) -> None:
        """token_limit_of: the caller's batch token limit (its key's batch_tokens=, else --batch-max-tokens)."""
        self.state, self.files, self.limits = state, files, limits
        self.tenant_of, self.wake, self.clock = tenant_of, wake, clock
        self.token_limit_of = token_limit_of or (lambda _: limits.max_tokens)

    # Files

    async def upload(self, tenant: str, upload: Any, purpose: Any, expires_after: tuple[Any, Any] | None = None
                     ) -> dict:
        """expires_after: OpenAI's (anchor, seconds) as the form sent them; None: the gateway's --batch-file-ttl."""
        if purpose != "batch":
            raise APIError(400, f"purpose must be \"batch\" (the files this gateway keeps are batch input), not "
                                f"{purpose!r:.40}", param="purpose")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "send the file as the multipart field `file`", param="file")
        ttl = self.limits.file_ttl_s if expires_after is None else expiry_seconds(*expires_after, "expires_after")
        size, lines = await asyncio.to_thread(_measure, upload.file)
        if size > self.limits.max_file_bytes:
            raise APIError(413, f"the file is {size} bytes, over this gateway's {self.limits.max_file_bytes}; split "
                                "it into several batches", code="file_too_large", param="file")
        if lines == 0 or lines > self.limits.max_lines:
            raise APIError(400, f"a batch file holds 1 to {self.limits.max_lines} requests, one JSON object per "
                                f"line; this one has {lines}", param="file")
        file_id = new_file_id()
        await store_call(self.files.put_from, file_id, upload.file)
        name = (upload.filename or "batch.jsonl")[:MAX_FILENAME]
        now = int(self.clock())
        record = FileRecord(file_id, tenant, size, now, name, "batch", now + ttl if ttl else None)
        await self.state.add_file(record)
        return record.public()

    async def own_file(self, tenant: str, file_id: str) -> FileRecord:
        record = await self.state.file(tenant, file_id)
        if record is None:
            raise not_found("file", file_id)
        return record

    async def list_files(self, tenant: str, purpose: str | None, after: str | None, limit: Any, order: str) -> dict:
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be asc or desc, not {order[:20]!r}", param="order")
        items = [f.public() for f in await self.state.files(tenant) if purpose is None or f.purpose == purpose]
        return page(items if order == "asc" else items[::-1], after, list_limit(limit))

    async def delete_file(self, tenant: str, file_id: str) -> dict:
        record = await self.own_file(tenant, file_id)
        await store_call(self.files.delete, file_id)  # the body first: a failure leaves the record to delete again
        await self.state.remove_file(record)
        return {"id": file_id, "object": "file", "deleted": True}

    # Batches

    async def create(self, tenant: str, body: Any, token_limit: int | None = None) -> dict:
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object: {input_file_id, endpoint, completion_window}")
        unknown = next((k for k in body if k not in ("input_file_id", "endpoint", "completion_window", "metadata",
                                                    "output_expires_after")), None)
        if unknown is not None:
            raise APIError(400, f"{unknown[:40]!r} is not a field of a batch", param=unknown[:40])
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, not {endpoint!r:.60}",
                           param="endpoint")
        window_s = window_seconds(body.get("completion_window"))
        metadata = check_metadata(body.get("metadata"))
        output_expiry = body.get("output_expires_after")
        if output_expiry is not None:
            if not isinstance(output_expiry, dict) or set(output_expiry) != {"anchor", "seconds"}:
                raise APIError(400, "output_expires_after must be {\"anchor\": \"created_at\", \"seconds\": N}",
                               param="output_expires_after")
            output_expiry = expiry_seconds(output_expiry["anchor"], output_expiry["seconds"], "output_expires_after")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise APIError(400, "input_file_id must be the id of a file uploaded with purpose \"batch\"",
                           param="input_file_id")
        source = await self.own_file(tenant, file_id)
        if source.purpose != "batch":
            raise APIError(400, f"{file_id} is a {source.purpose} file; upload the input with purpose \"batch\"",
                           param="input_file_id")
        unfinished = []
        for batch_id in await self.state.tenant_batch_ids(tenant):
            fields = await self.state.batch(batch_id)
            if fields is not None and fields["status"] not in FINISHED:
                unfinished.append(fields)
        if len(unfinished) >= self.limits.max_active:
            raise APIError(429, f"{len(unfinished)} of your batches are unfinished, this gateway's most per tenant; "
                                "wait for one to finish or cancel one", "rate_limit_error", code="too_many_batches",
                           headers={headers.RETRY_AFTER: "30"})
        now = int(self.clock())
        batch_id = new_batch_id()
        record = {"endpoint": endpoint, "input_file_id": file_id, "completion_window": body["completion_window"],
                  "created_at": now, "expires_at": now + window_s, "metadata": metadata,
                  "output_expires_after": output_expiry}
        if token_limit is not None:
            record["tokens"] = await self._within_token_limit(file_id, endpoint, unfinished, token_limit)
        await self.state.add_batch(batch_id, tenant, record, "validating", now)
        self.wake()
        return await self.retrieve(tenant, batch_id)

    async def _within_token_limit(self, file_id: str, endpoint: str, unfinished: list[dict], limit: int) -> int:
        """The batch's tokens (prompt estimate + max_tokens of its good lines), if they fit beside the tenant's
        unfinished batches' within `limit`: else 400 when the batch alone is over it, 429 while others hold it."""
        try:
            data = await store_call(self.files.read, file_id)
        except FileNotFoundError:
            raise not_found("file content", file_id) from None
        tokens = await asyncio.to_thread(file_tokens, data, endpoint)
        if tokens > limit:
            raise APIError(400, f"the batch would enqueue about {tokens} tokens (prompts, about four characters a "
                                f"token, and max_tokens), over your limit of {limit}; split it into smaller batches",
                           code="token_limit_exceeded", param="input_file_id")
        enqueued = sum(int(json.loads(f["record"]).get("tokens", 0)) for f in unfinished)
        if enqueued + tokens > limit:
            raise APIError(429, f"your unfinished batches hold about {enqueued} tokens and this one {tokens}, over "
                                f"your limit of {limit} enqueued tokens; wait for a batch to finish",
                           "rate_limit_error", code="token_limit_exceeded", headers={headers.RETRY_AFTER: "60"})
        return tokens

    async def _own_batch(self, tenant: str, batch_id: str) -> dict:
        fields = await self.state.batch(batch_id) if isinstance(batch_id, str) else None
        if fields is None or fields.get("tenant") != tenant:
            raise not_found("batch", str(batch_id))
        return fields

    async def retrieve(self, tenant: str, batch_id: str) -> dict:
        fields = await self._own_batch(tenant, batch_id)
        return public_batch(batch_id, fields, *await self.state.counts(batch_id, fields))

    async def list_batches(self, tenant: str, after: str | None, limit: Any) -> dict:
        items = []
        for batch_id in reversed(await self.state.tenant_batch_ids(tenant)):  # newest first, as OpenAI lists
            fields = await self.state.batch(batch_id)
            if fields is not None:
                items.append(public_batch(batch_id, fields, *await self.state.counts(batch_id, fields)))
        return page(items, after, list_limit(limit))

    async def cancel(self, tenant: str, batch_id: str) -> dict:
        fields = await self._own_batch(tenant, batch_id)
        if not await self.state.transition(batch_id, RUNNING, "cancelling", int(self.clock())):
            if fields["status"] not in ("cancelling", "cancelled"):
                raise APIError(409, f"batch {batch_id} is {fields['status']}; only a validating or in-progress batch "
                                    "can be cancelled", code="batch_not_cancellable")
        self.wake()
        return await self.retrieve(tenant, batch_id)


def _measure(file: Any) -> tuple[int, int]:
    """(bytes, non-blank lines) of an uploaded file, left at its start."""
    file.seek(0, 2)
    size = file.tell()
    file.seek(0)
    lines = sum(1 for line in file if line.strip())
    file.seek(0)
    return size, lines


async def _json_body(request: Request) -> Any:
    """The body as JSON, refused (400) where it is not, nests too deep, or holds text that is not Unicode (a lone
    surrogate in metadata would make every later answer about the batch unencodable)."""
    try:
        body = parse_json(await request.body())
        check_json_value(body)
    except RequestSchemaError as err:
        raise APIError(400, err.message, param=err.param) from None
    return body


async def store_call(do: Callable[..., T], *args: Any) -> T:
    """A file store call off the event loop; the store away (a full disk, an object store that does not answer) is a
    503 the client may retry, and nothing was recorded (FileNotFoundError passes: the caller says what is missing)."""
    try:
        return await asyncio.to_thread(do, *args)
    except FileNotFoundError:
        raise
    except OSError as err:
        log.warning("the batch file store failed: %s", err)
        raise APIError(503, "the batch file store is unavailable; retry shortly", "service_unavailable",
                       code="batch_store_unavailable", headers={headers.RETRY_AFTER: "5"}) from None


def install_batch_routes(app: FastAPI, service: BatchService) -> None:
    def tenant(request: Request) -> str:
        return service.tenant_of(request.headers)

    @app.exception_handler(RedisError)
    async def state_away(_: Request, err: RedisError) -> JSONResponse:
        """Redis (the batches' state) away: nothing is lost, the call can be made again shortly."""
        return APIError(503, f"the batch state store is unavailable ({type(err).__name__}); retry shortly",
                        "service_unavailable", code="batch_state_unavailable",
                        headers={headers.RETRY_AFTER: "2"}).response()

    @app.post("/v1/files")
    async def upload_file(request: Request) -> JSONResponse:
        who = tenant(request)
        try:
            async with request.form(max_files=1, max_fields=4) as form:
                expires = (form.get("expires_after[anchor]"), form.get("expires_after[seconds]"))
                return JSONResponse(await service.upload(who, form.get("file"), form.get("purpose"),
                                                         None if expires == (None, None) else expires))
        except HTTPException as err:  # starlette's multipart refusals (a malformed or oversized form)
            raise APIError(400, f"send multipart/form-data with the fields file and purpose: {err.detail}"[:300]
                           ) from None

    @app.get("/v1/files")
    async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                         limit: str | None = None, order: str = "desc") -> JSONResponse:
        return JSONResponse(await service.list_files(tenant(request), purpose, after, limit, order))

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(request: Request, file_id: str) -> JSONResponse:
        return JSONResponse((await service.own_file(tenant(request), file_id)).public())

    @app.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> Response:
        record = await service.own_file(tenant(request), file_id)
        try:
            data = await store_call(service.files.read, record.id)
        except FileNotFoundError:
            raise not_found("file content", file_id) from None
        return Response(data, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str) -> JSONResponse:
        return JSONResponse(await service.delete_file(tenant(request), file_id))

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> JSONResponse:
        who, limit = tenant(request), service.token_limit_of(request.headers)
        return JSONResponse(await service.create(who, await _json_body(request), limit))

    @app.get("/v1/batches")
    async def list_batches(request: Request, after: str | None = None, limit: str | None = None) -> JSONResponse:
        return JSONResponse(await service.list_batches(tenant(request), after, limit))

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(request: Request, batch_id: str) -> JSONResponse:
        return JSONResponse(await service.retrieve(tenant(request), batch_id))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> JSONResponse:
        return JSONResponse(await service.cancel(tenant(request), batch_id))
