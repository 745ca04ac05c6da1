"""The synchronous engine: requests in, one scheduled ragged batch per step, outputs back."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from kvfleet.engine.attention_select import select_attention_backend
from kvfleet.engine.block_manager import BlockManager
from kvfleet.engine.capacity_fit import DecodeStepFit
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.cuda_graphs import DecodeGraphs
from kvfleet.engine.kv_capacity import KVCapacity, plan_kv_cache
from kvfleet.engine.lora_adapter import AdapterError, read_adapter
from kvfleet.engine.lora_layers import LoraSlots
from kvfleet.engine.lora_registry import LoraRegistry, LoraSpec
from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.model_files import resolve_model
from kvfleet.engine.model_loader import load_model, pick_device, resolve_dtype
from kvfleet.engine.model_runner import ModelRunner
from kvfleet.engine.output_processor import RequestState
from kvfleet.engine.outputs import RequestOutput
from kvfleet.engine.sampler import Sampler, SampleResult
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.scheduler import Scheduler
from kvfleet.engine.sequence import Sequence
from kvfleet.engine.step_profile import StepProfile, step_kind
from kvfleet.engine.tokenizer import Tokenizer
from kvfleet.fleet.lora import parse_lora_module
from kvfleet.fleet.priority import BATCH_ENGINE_PRIORITY

log = logging.getLogger("kvfleet.engine")

DEFAULT_CPU_KV_CACHE_MEMORY = 1024**3
COMPUTE_ERROR = "the engine failed while computing this request"
SAMPLER_ERROR = "the engine failed while sampling this request's next token"
OUTPUT_ERROR = "the engine failed while turning this request's tokens into text"
MIN_MEASURED_PREFILL = 64  # prompt tokens a step must compute for its prefill rate to count (_measure_prefill)


class RequestError(ValueError):
    """A request the engine cannot take as given; the message says what to change."""


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    kv_blocks_total: int
    kv_blocks_free: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    max_num_seqs: int = 0
    prefill_tokens_pending: int = 0
    prefill_tokens_per_second: float = 0.0  # 0: not measured yet
    request_slot_seconds: float = 0.0  # 0: no request finished yet
    decode_tokens_per_second_full_batch: float = 0.0  # 0: not measured at two batch sizes yet
    max_loras: int = 0  # 0: LoRA off
    running_lora_adapters: tuple[str, ...] = ()  # the adapters of running and of waiting requests, by name
    waiting_lora_adapters: tuple[str, ...] = ()
    lora_adapter_reads: int = 0
    lora_slot_loads: int = 0


class EngineAsleepError(RuntimeError):
    """The engine sleeps (sleep mode): it runs nothing until woken."""


class EngineBusyError(RuntimeError):
    """Requests are in flight: the engine sleeps only when idle."""


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        self.device = pick_device(config.device)
        self.dtype, why = resolve_dtype(config.dtype, self.device)
        log.info("dtype: %s (%s)", str(self.dtype).removeprefix("torch."), why)
        self.attention_backend = select_attention_backend(config.attention_backend, self.device)
        self.model_dir = resolve_model(config.model)
        self.model_name = config.model
        self.startup_s: dict[str, float] = {}  # seconds of each start-up phase (kvfleet_startup_seconds)
        started = time.perf_counter()
        self.tokenizer = Tokenizer(self.model_dir)
        self.startup_s["tokenizer"], started = time.perf_counter() - started, time.perf_counter()
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.model, self.backend = load_model(
            self.model_dir, self.model_config, config.block_size, self.max_model_len, self.dtype, self.device,
            self.attention_backend, show_progress,
        )
        self.lora_slots, self.lora_registry = self._set_up_lora()
        self.startup_s["weights"], started = time.perf_counter() - started, time.perf_counter()
        self.capacity = self._plan_kv_cache()
        graphs = self._use_cuda_graphs()
        # with CUDA graphs one spare block past the block manager's: the padding rows of a replayed batch use it
        self.backend.allocate_kv_cache(self.capacity.num_blocks + (1 if graphs else 0))
        self.startup_s["kv_cache"], started = time.perf_counter() - started, time.perf_counter()
        log.info("%s", self.capacity.describe())
        log.info("attention backend: %s", self.attention_backend)
        self.block_manager = BlockManager(self.capacity.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.max_num_waiting,
            config.static_batching, config.max_loras if self.lora_slots is not None else None,
            BATCH_ENGINE_PRIORITY if config.background_yield else None, config.long_prefill_token_threshold,
        )
        self.runner = ModelRunner(self.model, self.backend, self.device, self._capture_graphs() if graphs else None,
                                  self.lora_slots)
        self.sampler = Sampler(config.seed)
        self.requests: dict[str, RequestState] = {}
        self._finished_outputs: list[RequestOutput] = []
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.last_batch_size = 0  # sequences in the latest step, for the batch-size metric
        # What a gateway needs to estimate a new request's time to first token (gateway/routing/pick.py EstimatedTTFT):
        # prompt tokens still to compute, and how fast steps have been computing them. Written by the engine thread.
        self.prefill_tokens_pending = 0
        self.prefill_rate = 0.0
        self.slot_seconds = 0.0  # how long finished requests held a batch slot (a moving average)
        self.decode_fit = DecodeStepFit(config.max_num_seqs)  # decode step time against batch size
        self.profile: StepProfile | None = None  # set one to learn where the steps' time goes (step_profile.py)
        self.sleeping = False  # sleep mode: the KV cache released (sleep(), wake_up())

    def _use_cuda_graphs(self) -> bool:
        return (self.device.type == "cuda" and self.attention_backend == "triton" and not self.config.enforce_eager
                and self.lora_slots is None)  # a replayed graph would not see each step's adapter plan

    def _set_up_lora(self) -> tuple[LoraSlots | None, LoraRegistry | None]:
        """The adapters' slots in the model and the registry of served adapters, with --lora-modules read and
        checked (AdapterError names the one that does not fit); (None, None) without --enable-lora."""
        config = self.config
        if not config.enable_lora:
            return None, None
        slots = LoraSlots(self.model, self.model_config, config.max_loras, config.max_lora_rank, self.dtype,
                          self.device)

        def read(name: str, directory) -> object:  # noqa: ANN001 - a Path
            return read_adapter(name, directory, self.model_config, config.max_lora_rank, self.dtype)

        registry = LoraRegistry(read, config.max_cpu_loras or config.max_loras, config.lora_allowed_dirs,
                                reserved_names=(self.model_name,))
        for module in config.lora_modules:
            name, path = parse_lora_module(module)
            registry.register(name, path, check_allowed=False)
        return slots, registry

    def _capture_graphs(self) -> DecodeGraphs:
        graphs = DecodeGraphs(self.model, self.backend, self.config.max_num_seqs, self.max_model_len,
                              pad_block=self.capacity.num_blocks)
        started = time.perf_counter()
        graphs.capture()
        self.startup_s["cuda_graphs"] = time.perf_counter() - started
        log.info("captured CUDA graphs of decode steps for batch sizes %s in %.1f s", graphs.sizes,
                 self.startup_s["cuda_graphs"])
        return graphs

    def _plan_kv_cache(self) -> KVCapacity:
        per_block = self.backend.bytes_per_block()
        if self.config.kv_cache_memory is not None or self.device.type != "cuda":
            memory = self.config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
            return plan_kv_cache(memory, per_block, self.config.block_size, self.max_model_len)
        return plan_kv_cache(self._profile_cuda_free_memory(), per_block, self.config.block_size,
                             self.max_model_len, memory_flag="--gpu-memory-utilization")

    def _profile_cuda_free_memory(self) -> int:
        """Run the largest batch once without a cache to learn peak activation memory, as vLLM does."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        with torch.inference_mode():
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            hidden = self.model.embed_tokens(ids)
            for layer in self.model.layers:  # attention-free pass bounds the MLP/projection activations
                hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            self.model.compute_logits(hidden[: self.config.max_num_seqs])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        return max(int(total * self.config.gpu_memory_utilization) - peak, 0)

    # --- requests -----------------------------------------------------------------------------

    def make_sequence(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                      priority: int = 0, lora: LoraSpec | None = None) -> Sequence:
        """Check a request and turn it into a Sequence; RequestError says what to change. Touches no engine state."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty; send at least one token")
            try:
                token_ids = self.tokenizer.encode(prompt)
            except ValueError as err:
                raise RequestError(str(err)) from err
        else:
            token_ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise RequestError(f"token ids must be integers in [0, {vocab}); got {bad[0]!r}")
        if not token_ids:
            raise RequestError("the prompt is empty; send at least one token")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({len(token_ids)} in the prompt, {params.max_tokens} in the completion). "
                "Please reduce the prompt or max_tokens."
            )
        if lora is not None and self.lora_registry is None:
            raise RequestError("this engine serves no LoRA adapters (start it with --enable-lora)")
        return Sequence(request_id or uuid.uuid4().hex, token_ids, params, priority=priority, lora=lora)

    def sleep(self) -> None:
        """Release the KV cache, as vLLM's sleep level 1 does (its contents, the prefix cache, are forgotten; a KV
        event says so). The weights stay where they are: on a CPU they are in host memory already; on a GPU they stay
        on it (vLLM's level 1 also copies them to host memory). Only an idle engine sleeps; asleep, it refuses
        requests until wake_up()."""
        if self.sleeping:
            return
        if self.has_unfinished_requests():
            raise EngineBusyError(f"{len(self.requests)} requests are in flight; an engine sleeps only when idle: "
                                  "stop sending it requests (drain it) and retry")
        self.block_manager.clear()
        self.runner.graphs = None  # captured graphs address the released cache
        self.backend.kv_cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.sleeping = True

    def wake_up(self) -> None:
        """Take the KV cache back (the same number of blocks), and recapture CUDA graphs where they are used."""
        if not self.sleeping:
            return
        graphs = self._use_cuda_graphs()
        self.backend.allocate_kv_cache(self.capacity.num_blocks + (1 if graphs else 0))
        if graphs:
            self.runner.graphs = self._capture_graphs()
        self.sleeping = False

    def add_sequence(self, seq: Sequence) -> None:
        if self.sleeping:
            raise EngineAsleepError("the engine is asleep (sleep mode); wake it with POST /wake_up, or send the "
                                    "request to another replica")
        if seq.request_id in self.requests:
            raise RequestError(f"request id {seq.request_id!r} is already in flight; use a unique id")
        self.scheduler.add(seq)
        self.requests[seq.request_id] = RequestState(seq, self.tokenizer, self.max_model_len)
        self.prefill_tokens_pending += seq.num_tokens

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, lora: LoraSpec | None = None) -> None:
        self.add_sequence(self.make_sequence(prompt, params, request_id, priority, lora))

    def abort_request(self, request_id: str) -> None:
        state = self.requests.get(request_id)
        if state is None:
            return
        state.finish("abort")
        self._finish(state)

    def abort_all(self) -> list[str]:
        """Abort every request in flight (the step failed for all) and drop their final outputs; their ids."""
        request_ids = list(self.requests)
        for request_id in request_ids:
            self.abort_request(request_id)
        self._finished_outputs = []
        return request_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._finished_outputs)

    # --- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, sample, and return every request's new output."""
        outputs, self._finished_outputs = self._finished_outputs, []
        scheduling = time.perf_counter()
        plan = self.scheduler.schedule()
        if self.lora_slots is not None:
            plan.scheduled = self._activate_adapters(plan.scheduled)
        self.last_batch_size = len(plan.scheduled)
        if plan.is_empty:
            self.prefill_tokens_pending = self.scheduler.prefill_tokens_pending()
            return outputs
        started = time.perf_counter()
        now = time.monotonic()
        for seq, _ in plan.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        sample_seqs, logits = self._run_isolating_failures(plan.scheduled)
        modelled = time.perf_counter()
        sampled = modelled
        if sample_seqs:
            sampled = self._sample(sample_seqs, logits)
        for seq in sample_seqs:
            state = self.requests.get(seq.request_id)
            if state is None:
                continue
            if state.finished:
                self._finish(state)
            else:
                outputs.append(state.make_output())
        outputs.extend(self._finished_outputs)
        self._finished_outputs = []
        ended = time.perf_counter()
        seconds = ended - started
        if self.profile is not None:
            prepare = self.runner.last_prepare_s
            self.profile.add(step_kind(plan.scheduled), {
                "schedule": started - scheduling, "prepare": prepare, "model": modelled - started - prepare,
                "sample": sampled - modelled, "outputs": ended - sampled})
        self._measure_prefill(plan, seconds)
        if all(n == 1 for _, n in plan.scheduled):
            self.decode_fit.add(len(plan.scheduled), seconds)
        return outputs

    def _activate_adapters(self, scheduled: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """Put the step's adapters in slots (reading any evicted from host memory again); a request whose adapter
        cannot be read any more fails alone. The step's batch without those."""
        specs = {seq.lora.id: seq.lora for seq, _ in scheduled if seq.lora is not None}
        adapters, failed = {}, {}
        for adapter_id, spec in specs.items():
            try:
                adapters[adapter_id] = self.lora_registry.adapter(spec)
            except (AdapterError, OSError) as err:
                log.error("the adapter %r could not be read again: %s", spec.name, err)
                failed[adapter_id] = f"the adapter {spec.name!r} could not be read again from {spec.path}: {err}"
        self.lora_slots.activate(adapters)
        if not failed:
            return scheduled
        for seq, _ in scheduled:
            if seq.lora is not None and seq.lora.id in failed:
                self._fail(seq, failed[seq.lora.id])
        return [(seq, n) for seq, n in scheduled if seq.lora is None or seq.lora.id not in failed]

    def _measure_prefill(self, plan, seconds: float) -> None:  # noqa: ANN001 - scheduler.SchedulerOutput
        """Prompt tokens computed per second in steps that computed at least MIN_MEASURED_PREFILL of them (and a
        block) (a moving average). In a step that also decoded, the decoding sequences' own share of it (the decode
        fit's per-sequence time) is not counted as prefill time; the step's fixed cost is (a prompt would pay it
        alone). A shorter prefill is not measured: its step's fixed cost and any stall of the process dominate it, so
        an engine whose prompts are mostly cached (the holder of a hot prefix) would read several times slower than
        it is, and a router would send the prefix's tenants away from their cache."""
        self.prefill_tokens_pending = self.scheduler.prefill_tokens_pending()
        prefill = sum(n for _, n in plan.scheduled if n > 1)
        decoding = sum(1 for _, n in plan.scheduled if n == 1)
        spent = seconds - decoding * self.decode_fit.per_sequence_s
        enough = max(self.config.block_size, MIN_MEASURED_PREFILL)
        if prefill >= enough and spent > 0.5 * seconds > 0:  # a fit that says otherwise is noise
            rate = prefill / spent
            self.prefill_rate = rate if not self.prefill_rate else 0.7 * self.prefill_rate + 0.3 * rate

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> float:
        """Sample the batch and apply each token to its request; returns when sampling ended (perf_counter)."""
        result = self._sample_isolating_failures(seqs, logits)
        sampled = time.perf_counter()
        for i, seq in enumerate(seqs):
            state = self.requests[seq.request_id]
            if i in result.errors:
                state.finish("error", error=result.errors[i])
                continue
            if not seq.output_token_ids:
                self.prompt_tokens += seq.num_prompt_tokens
            try:  # detokenizing and stop checks run per request: a failure there is that request's alone
                state.append_token(result.token_ids[i], result.logprobs[i])
            except Exception:  # noqa: BLE001 - fail only this request
                log.exception("request %s failed while its output was processed", seq.request_id)
                state.finish("error", error=OUTPUT_ERROR)
                continue
            self.generation_tokens += 1
        return sampled

    def _sample_isolating_failures(self, seqs: list[Sequence], logits: torch.Tensor) -> SampleResult:
        """Sample the batch; if the sampler raises, sample each row alone (random streams restored first), so a
        row that raises fails by itself and the others get the tokens they would have got."""
        generators = [(seq.generator, seq.generator.get_state()) for seq in seqs if seq.generator is not None]
        shared = self.sampler.generator.get_state()
        try:
            return self.sampler(logits, seqs)
        except Exception:  # noqa: BLE001 - isolate below
            log.exception("sampling a batch of %d failed; sampling each request alone", len(seqs))
        self.sampler.generator.set_state(shared)
        for generator, state in generators:
            generator.set_state(state)
        result = SampleResult([-1] * len(seqs), {}, [None] * len(seqs))
        for i, seq in enumerate(seqs):
            try:
                one = self.sampler(logits[i : i + 1], [seq])
            except Exception:  # noqa: BLE001 - fail only this request
                log.exception("sampling request %s failed", seq.request_id)
                result.errors[i] = SAMPLER_ERROR
                continue
            result.token_ids[i], result.logprobs[i] = one.token_ids[0], one.logprobs[0]
            if 0 in one.errors:
                result.errors[i] = one.errors[0]
        return result

    def _run_isolating_failures(self, scheduled: list[tuple[Sequence, int]]
                                ) -> tuple[list[Sequence], torch.Tensor]:
        """Run the batch; if it raises, run each sequence alone so one bad request fails by itself."""
        try:
            sample_seqs, logits = self.runner.execute(scheduled)
            done = scheduled
        except Exception:  # noqa: BLE001 - isolate below
            if len(scheduled) == 1:
                log.exception("a step failed for request %s", scheduled[0][0].request_id)
                self._fail(scheduled[0][0], COMPUTE_ERROR)
                return [], torch.empty(0)
            sample_seqs, rows, done = [], [], []
            for item in scheduled:
                try:
                    seqs, one = self.runner.execute([item])
                except Exception:  # noqa: BLE001 - fail only this request
                    log.exception("request %s failed inside a step", item[0].request_id)
                    self._fail(item[0], COMPUTE_ERROR)
                    continue
                done.append(item)
                sample_seqs += seqs
                rows.append(one)
            logits = torch.cat(rows) if rows else torch.empty(0)
        for seq, n in done:
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        return sample_seqs, logits

    def _fail(self, seq: Sequence, reason: str) -> None:
        state = self.requests.get(seq.request_id)
        if state is not None:
            state.finish("error", error=reason)
            self._finish(state)

    def _finish(self, state: RequestState) -> None:
        if state.seq.first_scheduled_time is not None and not state.seq.num_preemptions:
            held = time.monotonic() - state.seq.first_scheduled_time
            self.slot_seconds = held if not self.slot_seconds else 0.9 * self.slot_seconds + 0.1 * held
        self.scheduler.remove(state.seq)
        del self.requests[state.seq.request_id]
        self._finished_outputs.append(state.make_output())

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=bm.usage, kv_blocks_total=bm.num_blocks, kv_blocks_free=bm.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens, prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits, max_num_seqs=self.config.max_num_seqs,
            prefill_tokens_pending=self.prefill_tokens_pending, prefill_tokens_per_second=self.prefill_rate,
            request_slot_seconds=self.slot_seconds,
            decode_tokens_per_second_full_batch=self.decode_fit.tokens_per_s,
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict:
        if self.lora_slots is None:
            return {}
        running = {seq.lora.name for seq in self.scheduler.running if seq.lora is not None}
        waiting = {seq.lora.name for seq in self.scheduler.waiting if seq.lora is not None}
        return {"max_loras": self.config.max_loras, "running_lora_adapters": tuple(sorted(running)),
                "waiting_lora_adapters": tuple(sorted(waiting)), "lora_adapter_reads": self.lora_registry.loads,
                "lora_slot_loads": self.lora_slots.loads}

    # --- offline use --------------------------------------------------------------------------

    def generate(self, prompts: Seq[str | list[int]], params: SamplingParams | Seq[SamplingParams],
                 loras: Seq[str | None] | None = None) -> list[RequestOutput]:
        """Run prompts to completion (vLLM's LLM.generate); returns the final output of each, in order. loras: each
        prompt's adapter by name (None: the base model)."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if any(loras or ()) and self.lora_registry is None:
            raise RequestError("this engine serves no LoRA adapters (start it with --enable-lora)")
        specs = [None if name is None else self.lora_registry.get(name) for name in loras or [None] * len(prompts)]
        ids = [f"offline-{uuid.uuid4().hex}" for _ in prompts]
        for request_id, prompt, p, spec in zip(ids, prompts, params_list, specs, strict=True):
            self.add_request(request_id, prompt, p, lora=spec)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
