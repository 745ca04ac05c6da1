"""What an InferenceFleet's engine settings cost against a plan for its traffic (pure): context reserved beyond what
the traffic uses, requests that would not fit, a batch the KV cache cannot hold at the traffic's contexts."""

from __future__ import annotations

from kvfleet.fleet.sizes import format_size, parse_size
from kvfleet.operator.fleet_spec import FleetEngineSettings
from kvfleet.plan.sizing import Plan, Traffic

OVER_RESERVED = 2.0  # maxModelLen at least this many times what the traffic uses is worth a warning


def check_fleet(engine: FleetEngineSettings, plan: Plan, traffic: Traffic, kv_bytes_per_token: int) -> list[str]:
    """Warnings, each saying what it costs and what to set instead; [] when the fleet fits its traffic. `engine` is
    the fleet's spec.engine as the operator reads it (its defaults where the fleet says nothing)."""
    max_model_len, max_num_seqs, kv_memory = engine.max_model_len, engine.max_num_seqs, engine.kv_cache_memory
    kv_tokens = parse_size(kv_memory) // kv_bytes_per_token if kv_memory else None
    needed = traffic.prompt_p99 + traffic.output_p99
    warnings = []
    if max_model_len >= OVER_RESERVED * plan.max_model_len:
        cost = ""
        if kv_tokens:
            cost = (f" With kvCacheMemory {kv_memory} ({kv_tokens:,} tokens) {kv_tokens // max_model_len:,} requests "
                    f"can run to maxModelLen at once before the engine preempts; at {plan.max_model_len:,}, "
                    f"{kv_tokens // plan.max_model_len:,}.")
        warnings.append(
            f"maxModelLen {max_model_len:,} is {max_model_len / plan.max_model_len:.1f}x what the traffic uses (P99 "
            f"prompt + output: {needed:,} tokens; plan: {plan.max_model_len:,}).{cost} A chat request without "
            f"max_tokens may generate up to maxModelLen less its prompt, and the cache must hold one such sequence "
            f"({format_size(max_model_len * kv_bytes_per_token)}). Set maxModelLen: {plan.max_model_len}.")
    if max_model_len < needed:
        warnings.append(f"maxModelLen {max_model_len:,} is shorter than the P99 prompt + output ({needed:,} tokens): "
                        "more than 1 request in 100 of this traffic is refused (400 context_length_exceeded) or cut "
                        f"short. Set maxModelLen: {plan.max_model_len}.")
    if kv_tokens is not None and kv_tokens < max_num_seqs * traffic.context_p95:
        fits = max(1, kv_tokens // max(1, traffic.context_p95))
        warnings.append(f"kvCacheMemory {kv_memory} holds {kv_tokens:,} tokens: {fits:,} requests at the P95 context "
                        f"({traffic.context_p95:,} tokens), fewer than maxNumSeqs {max_num_seqs}; a full batch "
                        f"preempts and recomputes. Give it {format_size(plan.kv_bytes)} or set maxNumSeqs: {fits}.")
    return warnings
