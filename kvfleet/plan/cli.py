"""`kvfleet plan --log FILE`: recommend maxModelLen, KV memory, maxNumSeqs and replicas for a request log's traffic,
say why in plain words and print an InferenceFleet; `--check fleet.yaml` says what a fleet's settings cost against it
(exit 1 when they do not fit)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from kvfleet.autoscale_replay.engine_model import EngineModel
from kvfleet.autoscale_replay.slo import DEFAULT_ATTAINMENT, DEFAULT_TTFT_S, Slo, parse_classes
from kvfleet.autoscale_replay.trace import TraceError
from kvfleet.operator.fleet_spec import FleetEngineSettings, InvalidSpec, parse_fleet
from kvfleet.plan.check import check_fleet
from kvfleet.plan.request_log import read_requests
from kvfleet.plan.sizing import MAX_BATCH, Plan, describe, recommend

PROG = "kvfleet plan"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MEBIBYTE = 2**20


def build_parser() -> argparse.ArgumentParser:
    defaults = EngineModel()
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--log", type=Path, required=True, metavar="FILE",
                   help="the engine's request log (plain or --log-format json lines) or a CSV trace "
                        "(t,prompt_tokens,output_tokens,priority, as `kvfleet bench autoscale --trace` reads)")
    p.add_argument("--check", type=Path, metavar="FLEET_YAML", help="an InferenceFleet to check against the log")
    p.add_argument("--qps", type=float, help="target requests/s (default: the log's busiest minute)")
    p.add_argument("--max-tokens", type=int, help="the most output a request may ask for (default: the log's P99)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="its shape sets the KV bytes per token")
    p.add_argument("--dtype", choices=list(DTYPE_BYTES), default="float32",
                   help="of the KV cache: the engine's --dtype auto runs float32 on CPUs without bfloat16 "
                        "instructions, bfloat16 on GPUs and on CPUs with them (AVX-512 BF16, AMX)")
    p.add_argument("--block-size", type=int, default=None,
                   help="the engines' KV block size (default: the largest of 32, 16, 8 that wastes at most 4 %% of "
                        "the KV cache on this traffic)")
    p.add_argument("--name", default="chat", help="of the InferenceFleet printed")
    p.add_argument("--slo", default="", metavar="CLASS=S,...", help="TTFT objectives (default: " + ",".join(
        f"{k.value}={v:g}" for k, v in DEFAULT_TTFT_S.items()) + ")")
    p.add_argument("--attainment", default="", metavar="CLASS=F,...", help="attainment targets (default: " + ",".join(
        f"{k.value}={v:g}" for k, v in DEFAULT_ATTAINMENT.items()) + ")")
    p.add_argument("--max-replicas", type=int, default=64)
    m = p.add_argument_group("engine model (defaults: SmolLM2-135M on 2 CPU cores, from the engine benchmark; "
                             "measure yours with `kvfleet bench` and give them here)")
    m.add_argument("--capacity", type=float, default=defaults.capacity_rps,
                   help="requests/s of one pod at a full batch of --measured-batch (136 prompt, 64 output tokens)")
    m.add_argument("--measured-batch", type=int, default=defaults.max_num_seqs)
    m.add_argument("--prefill-tokens-per-s", type=float, default=defaults.prefill_tokens_per_s)
    m.add_argument("--half-rate-batch", type=float, default=defaults.half_rate_batch,
                   help="the batch at which decode gives half its limit")
    m.add_argument("--max-num-seqs", type=int, help="fix the batch instead of recommending one")
    return p


def fleet_yaml(plan: Plan, name: str, model: str, dtype_bytes: int) -> str:
    kv_mib = -(-plan.kv_bytes // MEBIBYTE)
    fleet = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceFleet", "metadata": {"name": name},
             "spec": {"model": model,
                      "engine": {"maxModelLen": plan.max_model_len, "maxNumSeqs": plan.max_num_seqs,
                                 "blockSize": plan.block_size, "kvCacheMemory": f"{kv_mib}Mi"},
                      "replicas": plan.replicas or 1,
                      "autoscaling": {"enabled": True, "minReplicas": 1,
                                      "maxReplicas": max(2, 2 * (plan.replicas or 1))}}}
    note = "" if dtype_bytes == 4 else "# kvCacheMemory sized for a 2-byte KV cache (GPU)\n"
    return note + yaml.safe_dump(fleet, sort_keys=False)


def _fleet_engine(path: Path) -> FleetEngineSettings:
    """The InferenceFleet's spec.engine as the operator reads it; ValueError (InvalidSpec) naming what to fix."""
    fleet = yaml.safe_load(path.read_text())
    spec = fleet.get("spec") if isinstance(fleet, dict) else None
    if not isinstance(spec, dict):
        raise ValueError(f"{path} is not an InferenceFleet: it has no spec; give the YAML you apply with kubectl")
    try:
        return parse_fleet("fleet", "default", spec).engine
    except InvalidSpec as err:
        raise ValueError(f"{path}: {err}") from None


def _kv_bytes_per_token(model: str, dtype: str) -> tuple[int, int]:
    from kvfleet.engine.model_config import ModelConfig  # the engine's arithmetic, one source
    from kvfleet.engine.model_files import resolve_model

    config = ModelConfig.from_dir(resolve_model(model))
    return config.kv_bytes_per_token * DTYPE_BYTES[dtype], config.max_position_embeddings


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        trace = read_requests(args.log)
        slo = Slo(parse_classes(args.slo, "--slo", DEFAULT_TTFT_S),
                  parse_classes(args.attainment, "--attainment", DEFAULT_ATTAINMENT))
        engine = EngineModel(capacity_rps=args.capacity, max_num_seqs=args.measured_batch,
                             prefill_tokens_per_s=args.prefill_tokens_per_s, half_rate_batch=args.half_rate_batch)
        for flag, value in (("--qps", args.qps), ("--max-tokens", args.max_tokens),
                            ("--max-num-seqs", args.max_num_seqs), ("--block-size", args.block_size)):
            if value is not None and not value > 0:
                raise ValueError(f"{flag} must be a positive number, not {value}")
        if not 1 <= args.max_replicas <= 1000:
            raise ValueError(f"--max-replicas must be from 1 to 1000, not {args.max_replicas}")
        for flag, value in (("--max-num-seqs", args.max_num_seqs), ("--measured-batch", args.measured_batch)):
            if value is not None and value > MAX_BATCH:
                raise ValueError(f"{flag} must be at most {MAX_BATCH} (an InferenceFleet's maxNumSeqs), not {value}")
        kv_per_token, model_max_len = _kv_bytes_per_token(args.model, args.dtype)
        fleet = _fleet_engine(args.check) if args.check else None
    except (TraceError, ValueError, OSError, yaml.YAMLError) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    plan = recommend(trace, block_size=args.block_size, kv_bytes_per_token=kv_per_token, engine=engine, slo=slo,
                     max_tokens=args.max_tokens, target_qps=args.qps, max_num_seqs=args.max_num_seqs,
                     max_position_embeddings=model_max_len, max_replicas=args.max_replicas)
    if fleet is not None:
        warnings = check_fleet(fleet, plan, describe(trace), kv_per_token)
        for warning in warnings:
            print(f"WARNING: {warning}")
        print(f"{args.check}: {'fits' if not warnings else f'{len(warnings)} warning(s)'} against {args.log}")
        return 1 if warnings else 0
    print("\n".join(f"- {reason}" for reason in plan.reasons))
    if plan.replicas is not None:
        met = ", ".join(f"{p.value} {a:.1%}" for p, a in plan.attainment.items() if a is not None)
        print(f"- With that many replicas the replay met: {met}.")
    print()
    print(fleet_yaml(plan, args.name, args.model, DTYPE_BYTES[args.dtype]), end="")
    return 0 if plan.replicas is not None else 1


if __name__ == "__main__":
    sys.exit(main())
