"""The models a gateway serves from Kubernetes: every InferenceFleet a label selector picks in its namespace (or
those it names), each a fleet behind the gateway's ModelFront. A fleet's `spec.model` is the name clients send,
`spec.gateway.modelAliases` other names for it, `spec.gateway.fallbackModel` the model its requests may fall back
to while it is saturated (the ladder's second rung), `spec.gateway.degradeMaxTokens` its own output caps while
saturated (the first rung: class -> tokens, over the gateway's --degrade-max-tokens); its engines are the pods
with its name in the fleet label (FLEET_LABEL), its Redis keys those of its name (kvfleet.fleet.redis_keys), which
the operator reads to scale it.

The fleets are listed every POLL_S (a handful of objects that change when someone applies one; each fleet's pods
are watched as a single fleet's are, gateway/engines/discovery.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kvfleet.fleet.pods import FLEET_GROUP, FLEET_LABEL, FLEET_PLURAL, FLEET_VERSION
from kvfleet.fleet.priority import Priority
from kvfleet.gateway.models.routes import ModelRoute, check_model_name, check_routes

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

log = logging.getLogger("kvfleet.gateway.fleets")

POLL_S = 5.0
GATEWAY_SECTION = "gateway"  # spec.gateway: what the gateway makes of the fleet's model


def routes_of_fleets(fleets: list[dict[str, Any]]) -> tuple[list[ModelRoute], list[str]]:
    """The routes of InferenceFleet objects (oldest name first where two claim one model name), and what was left
    out and why, in words for the log. Pure: whatever the objects hold, the routes pass check_routes."""
    routes: list[ModelRoute] = []
    problems: list[str] = []
    claimed: dict[str, str] = {}  # model name or alias -> fleet
    for fleet in sorted(fleets, key=lambda f: str((f.get("metadata") or {}).get("name", ""))):
        name = str((fleet.get("metadata") or {}).get("name", ""))
        spec = fleet.get("spec") if isinstance(fleet.get("spec"), dict) else {}
        section = spec.get(GATEWAY_SECTION) if isinstance(spec.get(GATEWAY_SECTION), dict) else {}
        try:
            model = check_model_name(spec.get("model") if isinstance(spec.get("model"), str) else "", "spec.model")
        except ValueError as err:
            problems.append(f"fleet {name!r} left out: {err}")
            continue
        if model in claimed:
            problems.append(f"fleet {name!r} left out: its model {model!r} is already served by fleet "
                            f"{claimed[model]!r}")
            continue
        claimed[model] = name
        aliases = []
        for alias in section.get("modelAliases") or []:
            if not isinstance(alias, str) or alias.strip() in claimed:
                problems.append(f"fleet {name!r}: alias {alias!r} left out (not a name, or already taken)")
                continue
            try:
                aliases.append(check_model_name(alias, "spec.gateway.modelAliases"))
            except ValueError as err:
                problems.append(f"fleet {name!r}: {err}")
                continue
            claimed[aliases[-1]] = name
        fallback = section.get("fallbackModel")
        routes.append(ModelRoute(model, name, k8s_selector=f"{FLEET_LABEL}={name}", aliases=tuple(aliases),
                                 fallback=fallback if isinstance(fallback, str) else None,
                                 degrade_max_tokens=_caps(name, section.get("degradeMaxTokens"), problems)))
    served = {r.name for r in routes}
    for i, route in enumerate(routes):
        if route.fallback is not None and (route.fallback not in served or route.fallback == route.name):
            problems.append(f"fleet {route.fleet!r}: fallbackModel {route.fallback!r} is no other model this "
                            f"gateway serves; no fallback")
            routes[i] = dataclasses.replace(route, fallback=None)
    check_routes(routes)
    return routes, problems


def _caps(fleet: str, given: object, problems: list[str]) -> dict[Priority, int] | None:
    """spec.gateway.degradeMaxTokens as class -> tokens; None where absent; bad entries left out and said."""
    if given is None:
        return None
    caps: dict[Priority, int] = {}
    for name, tokens in (given.items() if isinstance(given, dict) else ()):
        try:
            priority = Priority(name)
        except ValueError:
            priority = None
        if priority is None or isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            problems.append(f"fleet {fleet!r}: degradeMaxTokens {name!r}: {tokens!r} left out (a class and a "
                            "count of tokens >= 1)")
            continue
        caps[priority] = tokens
    if not isinstance(given, dict):
        problems.append(f"fleet {fleet!r}: degradeMaxTokens must map classes to tokens, not {given!r:.60}")
    return caps


class InferenceFleetRoutes:
    """Lists the InferenceFleets (by label selector, or by name) and reports their routes when they change."""

    def __init__(self, namespace: str, selector: str | None = None, names: tuple[str, ...] = (),
                 api_client: ApiClient | None = None, poll_s: float = POLL_S) -> None:
        from kubernetes.client import CustomObjectsApi

        from kvfleet.gateway.engines.discovery import _default_api_client

        self.namespace, self.selector, self.names, self.poll_s = namespace, selector, tuple(names), poll_s
        self._api = CustomObjectsApi(api_client or _default_api_client())

    async def run(self, on_change: Callable[[list[ModelRoute]], Awaitable[None]]) -> None:
        """Until cancelled; an API failure is logged and the last routes stay."""
        reported: list[ModelRoute] | None = None
        said: list[str] = []
        while True:
            try:
                fleets = await asyncio.to_thread(self._list)
            except Exception as err:  # the routes must outlive any API trouble; cancellation still passes through
                log.warning("listing InferenceFleets in %s failed (%s); the models served stay as they are",
                            self.namespace, err)
            else:
                routes, problems = routes_of_fleets(fleets)
                if problems != said:
                    for problem in problems:
                        log.warning("%s", problem)
                    said = problems
                if routes != reported:
                    await on_change(routes)
                    reported = routes
            await asyncio.sleep(self.poll_s)

    def _list(self) -> list[dict[str, Any]]:
        from kubernetes.client.exceptions import ApiException

        if not self.names:
            listed = self._api.list_namespaced_custom_object(FLEET_GROUP, FLEET_VERSION, self.namespace,
                                                             FLEET_PLURAL, label_selector=self.selector or "",
                                                             _request_timeout=(10, 30))
            return list(listed.get("items") or [])
        found = []
        for name in self.names:
            try:
                found.append(self._api.get_namespaced_custom_object(FLEET_GROUP, FLEET_VERSION, self.namespace,
                                                                    FLEET_PLURAL, name, _request_timeout=(10, 30)))
            except ApiException as err:
                if err.status != 404:
                    raise
                log.warning("InferenceFleet %s/%s does not exist (yet); its model is not served", self.namespace,
                            name)
        return found
