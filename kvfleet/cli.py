"""The `kvfleet` command."""

from __future__ import annotations

import argparse
import logging
import sys
import uuid

from kvfleet import __version__


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


def _engine(args: argparse.Namespace) -> int:
    from kvfleet.engine.cli_args import engine_config_from_args
    from kvfleet.engine.serve import serve

    return serve(engine_config_from_args(args), args.host, args.port, args.served_model_name, args.drain_timeout,
                 args.log_prompts)


def _add_engine_command(sub: argparse._SubParsersAction) -> None:
    from kvfleet.engine.cli_args import add_engine_args

    p = sub.add_parser("engine", help="serve the engine over an OpenAI-compatible HTTP API")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    p.add_argument("--log-prompts", action="store_true", help="include each request's prompt text in its log line")
    add_engine_args(p)
    p.set_defaults(func=_engine)


def _gateway(args: argparse.Namespace) -> int:
    from kvfleet.gateway.cli_args import gateway_config_from_args
    from kvfleet.gateway.serve import serve

    return serve(gateway_config_from_args(args), args.host, args.port)


def _add_gateway_command(sub: argparse._SubParsersAction) -> None:
    from kvfleet.gateway.cli_args import add_gateway_args

    p = sub.add_parser("gateway", help="route, queue and shed requests across a fleet of engines")
    add_gateway_args(p)
    p.set_defaults(func=_gateway)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfleet", description="LLM serving with batching at two levels")
    parser.add_argument("--version", action="version", version=f"kvfleet {__version__}")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=("plain", "json"), default="plain",
                        help="json: one JSON object per line (request lines carry their fields)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_engine_command(sub)
    _add_gateway_command(sub)
    _add_generation_command(sub, "chat", "answer one chat message with the engine (streams to stdout)")
    _add_generation_command(sub, "generate", "complete one plain prompt with the engine")
    return parser


def _configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        from kvfleet.engine.request_log import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.log_level, args.log_format)
    try:
        return args.func(args)
    except ValueError as exc:  # user-fixable configuration errors: say what to change, no traceback
        print(f"kvfleet: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
