"""Sleep mode over HTTP, as vLLM serves it (`--enable-sleep-mode`): `POST /sleep?level=1` releases the KV cache of an
idle engine, `POST /wake_up` takes it back, `GET /is_sleeping` says which. An autoscaler keeps such engines as a warm
pool: loaded, costing no KV memory, ready again in about a second rather than a cold start (operator/warm_pool.py).

Asleep, the engine answers generation requests 503 `engine_asleep` (a gateway tries another replica) and /ready 503
(`sleeping`: Kubernetes takes it out of the Service); /health stays 200, it is alive. Sleeping with requests in flight
is a 409, unless `drain=true` (kvfleet's): then /ready turns 503 at once, the engine still serves what reaches it
meanwhile, and sleeps as soon as no request runs (202, `sleep_pending`; /wake_up cancels it). /sleep and /wake_up need
the engine token when one is set (engine/server/api_key.py).
"""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvfleet.engine.llm_engine import EngineBusyError
from kvfleet.fleet.errors import APIError

log = logging.getLogger("kvfleet.engine")

SLEEP_LEVELS = ("1",)  # vLLM's level 2 also discards the weights; this engine keeps them (waking needs no reload)
WAKE_TAGS = ("weights", "kv_cache")  # vLLM's; the weights never leave, so any wakes the whole engine


def install_sleep_routes(app: FastAPI, state) -> None:  # noqa: ANN001 - api_server.ServerState (no cycle)
    def engine():  # noqa: ANN202 - an AsyncEngine
        found = state.require_engine()
        if not found.engine.config.enable_sleep_mode:
            raise APIError(404, "sleep mode is off; start the engine with --enable-sleep-mode to serve /sleep and "
                           "/wake_up", code="sleep_mode_off")
        return found

    @app.post("/sleep", responses={202: {"description": "drain: asleep once the requests in flight end"}})
    async def sleep(request: Request) -> JSONResponse:
        levels = request.query_params.getlist("level") or ["1"]
        if len(levels) > 1 or levels[0] not in SLEEP_LEVELS:
            raise APIError(400, f"level must be 1 (release the KV cache; this engine keeps its weights), not "
                           f"{', '.join(levels)[:40]!r}", param="level")
        drains = request.query_params.getlist("drain") or ["false"]
        if len(drains) > 1 or drains[0] not in ("true", "false"):
            raise APIError(400, f"drain must be true or false, not {', '.join(drains)[:40]!r}", param="drain")
        target = engine()
        started = time.perf_counter()
        try:
            asleep = await target.sleep(drain=drains[0] == "true")
        except EngineBusyError as err:
            raise APIError(409, f"{err}, or ask POST /sleep?drain=true", "conflict", code="engine_busy") from None
        if not asleep:
            log.info("sleep pending: not ready any more, asleep once the requests in flight end")
            return JSONResponse({"is_sleeping": False, "sleep_pending": True}, status_code=202)
        log.info("asleep: KV cache released in %.2f s", time.perf_counter() - started)
        return JSONResponse({"is_sleeping": True, "sleep_pending": False})

    @app.post("/wake_up")
    async def wake_up(request: Request) -> dict:
        tags = request.query_params.getlist("tags")
        unknown = [t for t in tags if t not in WAKE_TAGS]
        if unknown:
            raise APIError(400, f"tags may be {' or '.join(WAKE_TAGS)}, not {unknown[0][:40]!r}", param="tags")
        target = engine()
        started = time.perf_counter()
        await target.wake_up()
        log.info("awake: KV cache allocated in %.2f s", time.perf_counter() - started)
        return {"is_sleeping": False, "sleep_pending": False}

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict:
        target = engine()
        return {"is_sleeping": target.sleeping, "sleep_pending": target.sleep_pending}
