"""OpenAI's error body {"error": {"message", "type", "param", "code"}} with its HTTP status: every engine and gateway
error a client sees has this shape."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfleet.fleet.headers import ENGINE_FAULT, FAULT


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def engine_fault(message: str) -> APIError:
    """A 500 that is the engine's own fault (not the request's): marked so a gateway retries it elsewhere."""
    return APIError(500, message, "server_error", code="engine_fault", headers={FAULT: ENGINE_FAULT})


def install_error_handlers(app: FastAPI) -> None:
    """Every error a client can cause answers in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            message = "the body is not valid JSON; send a JSON object"
        else:
            message = f"{'.'.join(loc) or 'body'}: {first.get('msg')}"
        return APIError(400, message, param=".".join(loc) or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if err.status_code == 404 else str(err.detail)
        return APIError(err.status_code, message, "not_found_error" if err.status_code == 404 else
                        "invalid_request_error").response()
