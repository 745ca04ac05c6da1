"""Envoy's bootstrap for an Envoy that runs beside the gateway (the chart's sidecar container of the official Envoy
image) instead of as its child: the same builder as `--data-plane envoy` (envoy/bootstrap.py's build_bootstrap), with
the picker and the gateway's app at 127.0.0.1 in the pod. The chart's init container runs

    python -m kvfleet.gateway.envoy.sidecar --out /etc/envoy/envoy.json --envoy-port 8080 <the gateway's flags>

with the same flags as the gateway container (`--data-plane envoy-sidecar --port <app port> --picker-port ...
--envoy-endpoints-file ...`), so the limits Envoy enforces, the ports it calls and the engines' EDS file it watches
are the ones the picker and the app were started with."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvfleet.gateway.cli_args import add_gateway_args, gateway_config_from_args
from kvfleet.gateway.envoy.bootstrap import build_bootstrap
from kvfleet.gateway.envoy.eds import write_endpoints

DEFAULT_ENVOY_PORT = 8080
DEFAULT_ADMIN_PORT = 9901


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvfleet.gateway.envoy.sidecar",
                                description="write Envoy's bootstrap for a sidecar Envoy in front of "
                                            "`kvfleet gateway --data-plane envoy-sidecar` (same flags)")
    p.add_argument("--out", default="-", help="the file to write (default: stdout)")
    p.add_argument("--envoy-host", default="0.0.0.0", help="the address Envoy's listener binds")
    p.add_argument("--envoy-port", type=int, default=DEFAULT_ENVOY_PORT, help="Envoy's listener port (the Service's)")
    p.add_argument("--envoy-admin-port", type=int, default=DEFAULT_ADMIN_PORT,
                   help="Envoy's admin interface, on 127.0.0.1 only")
    add_gateway_args(p)
    return p


def sidecar_bootstrap(args: argparse.Namespace) -> tuple[dict, Path]:
    """The bootstrap and the engines' EDS file it names, from the parsed flags; ValueError for flags that clash."""
    config = gateway_config_from_args(args)
    if config.data_plane != "envoy-sidecar":
        raise ValueError("the sidecar's bootstrap goes with --data-plane envoy-sidecar (and its "
                         "--envoy-endpoints-file): pass the gateway container's own flags")
    if len({args.port, args.envoy_port, config.picker_port}) < 3:
        raise ValueError(f"--envoy-port {args.envoy_port}, --port {args.port} and --picker-port "
                         f"{config.picker_port} must differ: they share the pod's network")
    engines = Path(config.envoy_endpoints_file)
    return build_bootstrap(config, args.envoy_host, args.envoy_port, config.picker_port, args.port,
                           args.envoy_admin_port, engines), engines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        bootstrap, engines = sidecar_bootstrap(args)
    except ValueError as err:
        print(f"kvfleet envoy_sidecar: {err}", file=sys.stderr)
        return 2
    text = json.dumps(bootstrap, indent=1)
    if args.out == "-":
        print(text)
        return 0
    Path(args.out).write_text(text)
    # Envoy reads the engines' file when it starts, which may be before the gateway container has written it
    engines.parent.mkdir(parents=True, exist_ok=True)
    if not engines.exists():
        write_endpoints(engines, ())
    print(f"kvfleet envoy_sidecar: wrote {args.out} and {engines}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
