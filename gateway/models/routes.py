"""Which fleet serves a request's `model`, pure: the models one gateway fronts (each its own fleet, with its
engines, aliases, Redis keys and optional fallback model), read from flags such as `--engine NAME=URL`, and the
lookup a request's body goes through (an unknown model is OpenAI's 404 `model_not_found`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvfleet.fleet.errors import APIError
from kvfleet.fleet.priority import Priority

MAX_MODEL_NAME = 256
_FLEET_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class ModelRoute:
    """One model the gateway serves: the name clients send, the fleet behind it (its Redis keys are the fleet's,
    kvfleet.fleet.redis_keys) and how its engines are found (static URLs, or the pods a label selector picks)."""

    name: str
    fleet: str
    engines: tuple[str, ...] = ()
    k8s_selector: str | None = None
    aliases: tuple[str, ...] = ()
    tokenizer: str | None = None  # the engines' model, for the precise prefix index (None: approximate)
    fallback: str | None = None  # the model a saturated fleet's requests may go to (the ladder's second rung)
    degrade_max_tokens: dict[Priority, int] | None = None  # its own first rung (None: the gateway's)


def fleet_name_for(model: str) -> str:
    """A model's fleet name where nothing else gives one: its name with anything but letters, digits, '.', '_' and
    '-' made '-' (a fleet name is part of every Redis key)."""
    return _FLEET_UNSAFE.sub("-", model).strip("-") or "model"


def check_model_name(name: str, what: str) -> str:
    name = name.strip()
    if not name or len(name) > MAX_MODEL_NAME or not name.isprintable() or "=" in name or "," in name:
        raise ValueError(f"{what}: a model name must be 1-{MAX_MODEL_NAME} printable characters without '=' or ',', "
                         f"not {name[:80]!r}")
    return name


def split_named_value(value: str, flag: str = "--engine") -> tuple[str | None, str]:
    """'NAME=VALUE' -> (NAME, VALUE); a bare value (a URL's scheme comes before any '=') -> (None, value)."""
    name, sep, rest = value.partition("=")
    if not sep or "://" in name:
        return None, value
    return check_model_name(name, f"{flag} {value[:80]!r}"), rest


def routes_from_flags(engines: Iterable[str], aliases: Iterable[str] = (), tokenizers: Iterable[str] = (),
                      fallbacks: Iterable[str] = ()) -> list[ModelRoute]:
    """The routes of `--engine NAME=URL` flags (in the order names first appear), with `--model-alias ALIAS=NAME`,
    `--tokenizer NAME=MODEL` and `--fallback NAME=OTHER`; empty where every --engine is a bare URL (one fleet, the
    gateway's single-model mode). ValueError names the flag at fault."""
    engines = list(engines)
    named = [split_named_value(e) for e in engines]
    if not any(name for name, _ in named):
        for flag, values in (("--model-alias", aliases), ("--fallback", fallbacks)):
            if list(values):
                raise ValueError(f"{flag} needs models named by --engine NAME=URL")
        return []
    if not all(name for name, _ in named):
        raise ValueError("name every --engine (NAME=URL) once one is named: a bare URL belongs to no model")
    urls: dict[str, list[str]] = {}
    for name, url in named:
        urls.setdefault(name, []).append(url)
    per_model = {flag: _pairs(flag_values, flag, urls) for flag, flag_values in
                 (("--tokenizer", tokenizers), ("--fallback", fallbacks))}
    alias_of: dict[str, list[str]] = {}
    for alias, target in _alias_pairs(aliases, urls):
        alias_of.setdefault(target, []).append(alias)
    routes = [ModelRoute(name, fleet_name_for(name), tuple(found), aliases=tuple(alias_of.get(name, ())),
                         tokenizer=per_model["--tokenizer"].get(name), fallback=per_model["--fallback"].get(name))
              for name, found in urls.items()]
    check_routes(routes)
    return routes


def _pairs(values: Iterable[str], flag: str, known: Mapping[str, object]) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, other = value.partition("=")
        if not sep or not other.strip():
            raise ValueError(f"{flag} takes NAME=VALUE for a model named by --engine, not {value[:80]!r}")
        name = check_model_name(name, flag)
        if name not in known:
            raise ValueError(f"{flag} {value[:80]!r}: no --engine serves a model named {name!r}")
        out[name] = other.strip()
    return out


def _alias_pairs(values: Iterable[str], known: Mapping[str, object]) -> list[tuple[str, str]]:
    pairs = []
    for value in values:
        alias, sep, name = value.partition("=")
        if not sep:
            raise ValueError(f"--model-alias takes ALIAS=NAME, not {value[:80]!r}")
        alias, name = check_model_name(alias, "--model-alias"), check_model_name(name, "--model-alias")
        if name not in known:
            raise ValueError(f"--model-alias {value[:80]!r}: no --engine serves a model named {name!r}")
        pairs.append((alias, name))
    return pairs


def check_routes(routes: list[ModelRoute]) -> None:
    """Every name and alias leads to one model, every fleet name to one model, every fallback to another model."""
    owner: dict[str, str] = {}
    fleets: dict[str, str] = {}
    for route in routes:
        for name in (route.name, *route.aliases):
            if owner.setdefault(name, route.name) != route.name:
                raise ValueError(f"the model name {name!r} is claimed by {owner[name]!r} and {route.name!r}")
        if fleets.setdefault(route.fleet, route.name) != route.name:
            raise ValueError(f"models {fleets[route.fleet]!r} and {route.name!r} would share the fleet name "
                             f"{route.fleet!r} (and its Redis keys); rename one")
    names = {r.name for r in routes}
    for route in routes:
        if route.fallback is not None and (route.fallback == route.name or route.fallback not in names):
            raise ValueError(f"model {route.name!r}: its fallback must be another model this gateway serves "
                             f"({', '.join(sorted(names - {route.name})) or 'none'}), not {route.fallback!r}")


class ModelTable:
    """The names and aliases clients may send, each leading to one route."""

    def __init__(self, routes: Iterable[ModelRoute]) -> None:
        self.routes = {r.name: r for r in routes}
        self._names = {name: r.name for r in self.routes.values() for name in (r.name, *r.aliases)}

    def resolve(self, requested: object) -> str:
        """The served model's name for a body's `model`; 404 (OpenAI's body) for one nobody serves, 400 where it
        is missing and more than one model is served."""
        if requested is None:
            if len(self.routes) == 1:
                return next(iter(self.routes))
            raise APIError(400, f"`model` is required: this gateway serves {self.listing()}", param="model",
                           code="model_required")
        name = self._names.get(requested) if isinstance(requested, str) else None
        if name is None:
            shown = requested[:200] if isinstance(requested, str) else requested
            raise APIError(404, f"The model `{shown}` does not exist; this gateway serves {self.listing()}",
                           param="model", code="model_not_found")
        return name

    @property
    def names(self) -> frozenset[str]:
        """Every model name and alias clients may send."""
        return frozenset(self._names)

    def listing(self, limit: int = 20) -> str:
        names = sorted(self._names)
        more = f" and {len(names) - limit} more (GET /v1/models)" if len(names) > limit else ""
        return ", ".join(f"`{n}`" for n in names[:limit]) + more
