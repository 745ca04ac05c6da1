"""`kvfleet gateway`'s HTTP app (FastAPI): health, readiness, metrics, the model list, the two generation routes,
which the Python front (python_front.py) serves, and with --batch-dir the Batch API (gateway/batch/); `gateway` is
one fleet's core (core.py) or a front of several (models/front.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvfleet.fleet.body_limit import BodyLimit
from kvfleet.fleet.errors import install_error_handlers
from kvfleet.fleet.http_limits import BodyDeadline
from kvfleet.gateway.core import Gateway
from kvfleet.gateway.envoy.handoff import HOP_HEADER, Handoffs, serve_handoff
from kvfleet.gateway.python_front import handle_request

FILES_PATH = "/v1/files"  # uploads: the Batch API's file limit, not a request body's
MULTIPART_SLACK = 64 * 1024  # a multipart body's boundaries and headers around the file


def build_app(gateway: Gateway, handoffs: Handoffs | None = None) -> FastAPI:
    """`handoffs`: the requests the Envoy plane's picker hands to this app to relay and migrate (envoy/handoff.py);
    None where no Envoy of kvfleet's does."""
    batch = None
    if gateway.config.batch is not None:
        from kvfleet.gateway.batch.wire import BatchApi

        batch = BatchApi(gateway)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        if batch is not None:
            batch.start()
        try:
            yield
        finally:
            if batch is not None:
                await batch.stop()
            await gateway.stop()

    docs = gateway.config.enable_docs  # off by default: the API's shape is no business of anonymous clients
    app = FastAPI(title="kvfleet gateway", version="0.1.0", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    files_limit = {} if batch is None else {FILES_PATH: (gateway.config.batch.max_file_bytes + MULTIPART_SLACK,
                                                         "split the file into several batches")}
    app.add_middleware(BodyLimit, max_bytes=gateway.config.max_body_bytes, by_path=files_limit)
    app.add_middleware(BodyDeadline, seconds=gateway.config.http_limits.body_timeout_s)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return JSONResponse(gateway.ready_body(), status_code=503 if gateway.picker_serving is False else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await gateway.models_response(request.headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        if handoffs is not None and HOP_HEADER in request.headers:
            return await serve_handoff(handoffs, request, "/v1/completions")
        return await handle_request(gateway, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        if handoffs is not None and HOP_HEADER in request.headers:
            return await serve_handoff(handoffs, request, "/v1/chat/completions")
        return await handle_request(gateway, request, "/v1/chat/completions")

    if batch is not None:
        batch.install(app)
    return app
