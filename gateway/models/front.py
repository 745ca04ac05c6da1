"""One gateway for several models: each model is a fleet of its own (a Gateway: its engines, queue, limits, Redis
keys and metrics), and the front sends each request to the fleet its body's `model` names (gateway/models/routes.py).

The front checks the API key before it reads a body, finds the model, and lets the ladder's second rung send the
request to the model's fallback while its own fleet is saturated and the fallback has room, where the client (the
x-kvfleet-allow-fallback header) or its key (allow_fallback=true) allows. /v1/models lists every model and alias;
/metrics carries every fleet's series with a `model` label (series without it: requests refused before a model was
known); /ready reports each fleet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable, Iterable, Mapping

from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from kvfleet.fleet import headers
from kvfleet.fleet.errors import APIError
from kvfleet.fleet.priority import Priority
from kvfleet.gateway.admission import no_engine
from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.core import Gateway
from kvfleet.gateway.degradation import fallback_allowed, fallback_header_value
from kvfleet.gateway.director import Target, Ticket, check_body, check_headers
from kvfleet.gateway.engines.pool import EndpointPool
from kvfleet.gateway.limits.access import authenticate
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.models.routes import ModelRoute, ModelTable
from kvfleet.gateway.prefix.worth import Tokenize

log = logging.getLogger("kvfleet.gateway.models")

MODEL_LABEL = "model"


class FleetsPool:
    """Every fleet's engines as one pool, for what serves them all (Envoy's EDS file, its access log feed)."""

    def __init__(self, fleets: Callable[[], Iterable[Gateway]]) -> None:
        self._fleets = fleets
        self.membership_changed = asyncio.Event()  # every fleet's pool sets this one

    def urls(self) -> list[str]:
        return [url for g in self._fleets() for url in g.pool.urls()]

    def owner(self, url: str) -> EndpointPool | None:
        return next((g.pool for g in self._fleets() if url in g.pool.endpoints), None)

    def record_outcome(self, url: str, ok: bool) -> bool:
        pool = self.owner(url)
        return pool.record_outcome(url, ok) if pool is not None else False

    @property
    def eject_seconds(self) -> float:
        return next((g.pool.eject_seconds for g in self._fleets()), 0.0)


class ModelLabelled:
    """A Prometheus collector: the registries' families merged, each sample labelled with its fleet's model."""

    def __init__(self, sources: Callable[[], Iterable[tuple[str, CollectorRegistry]]]) -> None:
        self.sources = sources

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for model, registry in self.sources():
            for family in registry.collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    labels = {MODEL_LABEL: model, **sample.labels} if model else sample.labels
                    into.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
        return merged.values()


class ModelFront:
    """Several fleets behind one gateway, duck-typed as a Gateway for the data planes (build_app, the picker)."""

    def __init__(self, config: GatewayConfig, routes: list[ModelRoute],
                 tokenizer_for: Callable[[str | None], Tokenize | None] = lambda _: None) -> None:
        self.config = config
        self.metrics = GatewayMetrics()  # requests refused before their model is known
        self.tokenizer_for = tokenizer_for
        self.routes = list(routes)
        self.table = ModelTable(self.routes)
        self.fleets: dict[str, Gateway] = {}
        self.pool = FleetsPool(lambda: list(self.fleets.values()))
        self.keys: object | None = None  # the API keys, shared by every fleet (each counts its own limits)
        self.picker_serving: bool | None = None if config.data_plane == "python" else False
        # models/inference_fleets.py's InferenceFleetRoutes when the models come from Kubernetes
        self.fleet_routes = None
        self._watching: asyncio.Task | None = None
        self._changing = asyncio.Lock()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(ModelLabelled(self._registries))

    def _fleet(self, route: ModelRoute) -> Gateway:
        config = dataclasses.replace(self.config, engines=list(route.engines), k8s_selector=route.k8s_selector,
                                     fleet=route.fleet, tokenizer=route.tokenizer, models=[], k8s_fleets=[],
                                     k8s_fleet_selector=None)
        if route.degrade_max_tokens is not None:  # its own ladder's first rung
            config.degrade_max_tokens = dict(route.degrade_max_tokens)
        gateway = Gateway(config, tokenize=self.tokenizer_for(route.tokenizer), route=route)
        gateway.keys = self.keys
        gateway.pool.membership_changed = self.pool.membership_changed
        return gateway

    # ---- life cycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.set_routes(self.routes)
        c = self.config
        if c.k8s_fleets or c.k8s_fleet_selector is not None:
            from kvfleet.gateway.models.inference_fleets import InferenceFleetRoutes

            self.fleet_routes = self.fleet_routes or InferenceFleetRoutes(c.k8s_namespace, c.k8s_fleet_selector,
                                                                          tuple(c.k8s_fleets))
            self._watching = asyncio.create_task(self.fleet_routes.run(self.set_routes), name="InferenceFleets")

    async def stop(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
            await asyncio.gather(self._watching, return_exceptions=True)
        fleets, self.fleets = list(self.fleets.values()), {}
        await asyncio.gather(*(g.stop() for g in fleets), return_exceptions=True)

    async def set_routes(self, routes: list[ModelRoute]) -> None:
        """The models served from now on: new ones start, removed ones stop (their queued requests end as at a
        gateway's shutdown), changed ones restart."""
        async with self._changing:
            await self._set_routes(routes)

    async def _set_routes(self, routes: list[ModelRoute]) -> None:
        self.routes, self.table = list(routes), ModelTable(routes)
        wanted = {r.name: r for r in routes}
        gone = [name for name, g in self.fleets.items() if name not in wanted or g.route != wanted[name]]
        for name in gone:
            await self.fleets.pop(name).stop()
        for name, route in wanted.items():
            if name not in self.fleets:
                gateway = self._fleet(route)
                await gateway.start()
                self.fleets[name] = gateway
        if gone:  # a new fleet's engines set it as discovery adds them
            self.pool.membership_changed.set()
        log.info("models: %s", ", ".join(sorted(wanted)) or "none")

    # ---- one request: the front's calls into the director (gateway/director.py) ------------------------------
    def check_headers(self, request_headers: Mapping[str, str], priority: Priority) -> Ticket:
        """What the request's headers allow, before its body is read: the key once for every fleet, and whether it
        may go to its model's fallback (the client's x-kvfleet-allow-fallback, or its key's allow_fallback)."""
        ticket = check_headers(self.config, self.keys, request_headers, priority)
        try:
            may_fall_back = fallback_allowed(request_headers.get(headers.ALLOW_FALLBACK),
                                             getattr(ticket.key, "allow_fallback", False))
        except ValueError as err:
            raise APIError(400, f"{headers.ALLOW_FALLBACK} {err}", param=headers.ALLOW_FALLBACK) from None
        return dataclasses.replace(ticket, may_fall_back=may_fall_back)

    def target(self, ticket: Ticket, path: str, raw: bytes) -> Target:
        """The fleet of the body's model (or its fallback's, the ladder's second rung), and the body as that fleet's
        engines know their model; an adapter's request goes to its base model's fleet, under its own name."""
        body = check_body(path, raw)
        adapter_of = self._adapter_owner(body.get("model"))
        if adapter_of is not None:
            return Target(adapter_of, path, raw, body)
        name = self.table.resolve(body.get("model"))
        gateway = self._serving(name, ticket.may_fall_back)
        served = gateway.route.name
        renamed = body.get("model") not in (None, served)  # an alias, or the fallback: engines know one name
        if renamed:
            body["model"] = served
        return Target(gateway, path, raw, body, renamed, fallback_header_value(served) if served != name else None)

    def _adapter_owner(self, model: object) -> Gateway | None:
        """The fleet whose engines serve a LoRA adapter of this name (a model's own name or alias wins)."""
        if not isinstance(model, str) or model in self.table.names:
            return None
        return next((g for g in self.fleets.values() if g.adapters and g.adapters.adapter_of(model)), None)

    def _serving(self, name: str, may_fall_back: bool) -> Gateway:
        gateway = self.fleets.get(name)
        if gateway is None:  # listed, but its fleet is starting or stopping
            raise no_engine(f"the model `{name}` is not being served yet")
        fallback = self.fleets.get(self.table.routes[name].fallback or "")
        if may_fall_back and fallback is not None and not gateway.has_room() and fallback.has_room():
            return fallback
        return gateway

    async def batch_models(self) -> dict[str, tuple[Gateway, str]]:
        """The names a batch line may give as its model (models, aliases, adapters), each with the fleet that serves
        it and the name its engines know it by."""
        out: dict[str, tuple[Gateway, str]] = {}
        for route in self.routes:
            gateway = self.fleets.get(route.name)
            if gateway is None:
                continue
            for name in (route.name, *route.aliases):
                out[name] = (gateway, route.name)
            for adapter in sorted(gateway.adapters.names) if gateway.adapters else ():
                out.setdefault(adapter, (gateway, adapter))
        return out

    # ---- status -------------------------------------------------------------------------------------------
    async def models_response(self, request_headers: Mapping[str, str]) -> Response:
        """Every model and alias; an engine's own entry where one answers (its max_model_len and so on)."""
        key = authenticate(self.keys, request_headers)
        first = next(iter(self.fleets.values()), None)
        if first is not None:  # counted once, against the first model's limits
            await first.count_call(key)
        entries = await asyncio.gather(*(self._model_entry(r) for r in self.routes))
        data = []
        for route, entry in zip(self.routes, entries, strict=True):
            data.append(entry)
            data.extend({**entry, "id": alias, "root": route.name} for alias in route.aliases)
            gateway = self.fleets.get(route.name)
            adapters = sorted(gateway.adapters.names) if gateway and gateway.adapters else []
            data.extend({"id": name, "object": "model", "created": 0, "owned_by": "kvfleet", "parent": route.name}
                        for name in adapters)
        return Response(json.dumps({"object": "list", "data": data}), media_type="application/json")

    async def _model_entry(self, route: ModelRoute) -> dict:
        entry = {"id": route.name, "object": "model", "created": 0, "owned_by": "kvfleet", "root": route.name}
        gateway = self.fleets.get(route.name)
        if gateway is None:
            return entry
        try:
            upstream, _ = await gateway.engine_models()
            listed = upstream.json().get("data") or []
        except (APIError, ValueError, AttributeError):
            return entry
        found = next((m for m in listed if isinstance(m, dict) and m.get("id") == route.name), None)
        return {**found, "root": route.name} if found else entry

    def ready_body(self) -> dict:
        fleets = {name: g.ready_body() for name, g in self.fleets.items()}
        body = {"status": "ready", "models": fleets,
                **{k: sum(f[k] for f in fleets.values()) for k in ("engines", "healthy", "available", "queued")}}
        if self.picker_serving is False:
            body["status"] = "picker not serving"
        return body

    def render_metrics(self) -> bytes:
        for gateway in self.fleets.values():
            gateway.refresh_gauges()
        return generate_latest(self._registry)

    def _registries(self) -> Iterable[tuple[str, CollectorRegistry]]:
        yield "", self.metrics.registry
        for name, gateway in list(self.fleets.items()):
            yield name, gateway.metrics.registry
