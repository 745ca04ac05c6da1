"""The engine metric names the fleet reads and writes (ARCHITECTURE.md's "Engine metrics"), each written once.

The engine exports them; the gateway and the operator read the load signals, accepting vLLM's names too so they
can front vLLM pods. Counters are named here as a family: Prometheus exposes their samples with a `_total` suffix.
"""

from __future__ import annotations

# Load signals: what routing, shedding and autoscaling read.
KV_CACHE_USAGE = "kvfleet_kv_cache_usage"  # 0-1
NUM_REQUESTS_RUNNING = "kvfleet_num_requests_running"
NUM_REQUESTS_WAITING = "kvfleet_num_requests_waiting"
MAX_NUM_SEQS = "kvfleet_max_num_seqs"  # kvfleet engines export it; vLLM's metrics do not
# For the gateway's estimate of a new request's time to first token (kvfleet engines only): prompt tokens queued or
# part-computed, and the rate steps compute them at (0 until measured).
PREFILL_TOKENS_PENDING = "kvfleet_prefill_tokens_pending"
PREFILL_TOKENS_PER_SECOND = "kvfleet_prefill_tokens_per_second"
REQUEST_SLOT_SECONDS = "kvfleet_request_slot_seconds"  # how long a request holds a batch slot (moving average)
# For the autoscaler's capacity model: decode tokens/s the engine would give at a full batch (max_num_seqs), from its
# measured step times (0 until measured).
DECODE_TOKENS_PER_SECOND_FULL_BATCH = "kvfleet_decode_tokens_per_second_full_batch"

# vLLM's names for the same signals (vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc).
VLLM_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
VLLM_GPU_CACHE_USAGE = "vllm:gpu_cache_usage_perc"
VLLM_NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
VLLM_NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
# vLLM's counters for what kvfleet's engine counts as PREFIX_CACHE_*, PROMPT_TOKENS and E2E_REQUEST_LATENCY (in tokens
# too, so the hit rates read alike).
VLLM_PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
VLLM_PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens"
VLLM_E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"
VLLM_TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
# vLLM's per-request histograms (their _sum and _count) from which the gateway learns what vLLM does not export and
# kvfleet's engine does (REQUEST_SLOT_SECONDS, PREFILL_TOKENS_PER_SECOND, PREFILL_TOKENS_PENDING): see
# gateway/engines/learned.py
VLLM_INFERENCE_SECONDS = "vllm:request_inference_time_seconds"  # a request's time running: prefill and decode
VLLM_PREFILL_SECONDS = "vllm:request_prefill_time_seconds"
VLLM_PREFILL_COMPUTED_TOKENS = "vllm:request_prefill_kv_computed_tokens"  # its prompt tokens not found in the cache

# For each load signal, the names that carry it, in order of preference.
LOAD_SIGNALS: dict[str, tuple[str, ...]] = {
    "kv_cache_usage": (KV_CACHE_USAGE, VLLM_KV_CACHE_USAGE, VLLM_GPU_CACHE_USAGE),
    "num_waiting": (NUM_REQUESTS_WAITING, VLLM_NUM_REQUESTS_WAITING),
    "num_running": (NUM_REQUESTS_RUNNING, VLLM_NUM_REQUESTS_RUNNING),
}

# The rest of the engine's gauges and counters.
KV_CACHE_BLOCKS_TOTAL = "kvfleet_kv_cache_blocks_total"
KV_CACHE_BLOCKS_FREE = "kvfleet_kv_cache_blocks_free"
NUM_PREEMPTIONS = "kvfleet_num_preemptions"
PROMPT_TOKENS = "kvfleet_prompt_tokens"
GENERATION_TOKENS = "kvfleet_generation_tokens"
PREFIX_CACHE_QUERIES = "kvfleet_prefix_cache_queries"
PREFIX_CACHE_HITS = "kvfleet_prefix_cache_hits"
REQUESTS_REJECTED = "kvfleet_requests_rejected"  # label `reason`
REQUEST_IGNORED_FIELDS = "kvfleet_request_ignored_fields"
# Where a cold start goes (label `phase`, STARTUP_PHASES), set once when the engine turns ready: the autoscaler's
# cold start, measured instead of assumed.
STARTUP_SECONDS = "kvfleet_startup_seconds"
STARTUP_PHASES = ("imports", "tokenizer", "weights", "kv_cache", "warmup", "total")  # total: process start to ready

# Multi-LoRA, in vLLM's shape (vllm:lora_requests_info, which the Gateway API Inference Extension's picker reads): a
# gauge set to the scrape's time, its labels the engine's adapter cap and the adapters of running and of waiting
# requests, comma-joined. The readers accept vLLM's name too.
LORA_REQUESTS_INFO = "kvfleet_lora_requests_info"
VLLM_LORA_REQUESTS_INFO = "vllm:lora_requests_info"
LORA_INFO_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")
LORA_ADAPTER_READS = "kvfleet_lora_adapter_reads"  # adapters read from disk (registered, or read again after eviction)
LORA_SLOT_LOADS = "kvfleet_lora_slot_loads"  # adapters copied into a slot of the batch's stacked weights

# Histograms.
TIME_TO_FIRST_TOKEN = "kvfleet_time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "kvfleet_inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "kvfleet_e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "kvfleet_request_queue_time_seconds"
BATCH_SIZE = "kvfleet_batch_size"
STEP_SECONDS = "kvfleet_step_seconds"
