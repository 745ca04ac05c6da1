"""An asyncio front on the engine: the step loop runs in its own thread; coroutines submit, stream and abort.

Only the engine thread touches the engine's state. Coroutines hand it commands through a
thread-safe inbox and get outputs back on their event loop with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvfleet.engine.kv_event_hub import KVEventHub
from kvfleet.engine.llm_engine import EngineAsleepError, EngineStats, LLMEngine
from kvfleet.engine.lora_registry import LoraRegistry, LoraSpec
from kvfleet.engine.metrics import EngineMetrics
from kvfleet.engine.outputs import RequestOutput
from kvfleet.engine.request_log import log_finished
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sequence import Sequence
from kvfleet.engine.tokenizer import Tokenizer

log = logging.getLogger("kvfleet.engine")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None, log_prompts: bool = False,
                 kv_events: KVEventHub | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.log_prompts = log_prompts
        self.kv_events = kv_events  # where the prefix cache's block events go after each step
        if kv_events is not None:
            if engine.block_manager.events is None:
                engine.block_manager.events = []
            kv_events.publish(engine.block_manager.take_events())  # what the warm-up cached
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._sleep_when_idle = False  # sleep mode, drained: the engine sleeps once no request runs
        self._thread = threading.Thread(target=self._run, name="kvfleet-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # ---- what the HTTP servers read of the engine: fixed at load, or a snapshot (stats) --------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def model_dir(self) -> Path:
        return self.engine.model_dir

    @property
    def lora_registry(self) -> LoraRegistry | None:
        """The adapters served (thread-safe: the API server's threads register, the engine thread reads)."""
        return self.engine.lora_registry

    @property
    def sleeping(self) -> bool:
        return self.engine.sleeping

    @property
    def sleep_pending(self) -> bool:
        """Asked to sleep once idle (sleep(drain=True)); it still serves what comes meanwhile."""
        return self._sleep_when_idle

    async def sleep(self, drain: bool = False) -> bool:
        """Release the KV cache (LLMEngine.sleep, on the engine thread); True once asleep. While requests run:
        EngineBusyError, or with `drain` False returned and the engine sleeps as soon as none runs."""
        def now_or_later() -> bool:
            if drain and self.engine.has_unfinished_requests():
                self._sleep_when_idle = True
                return False
            self.engine.sleep()
            return True
        return await self._on_engine_thread(now_or_later)

    async def wake_up(self) -> None:
        def wake() -> None:
            self._sleep_when_idle = False
            self.engine.wake_up()
        await self._on_engine_thread(wake)

    async def _on_engine_thread(self, call: Callable[[], object]) -> object:
        if not self.is_alive:
            raise EngineDeadError("the engine has stopped")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send("call", (call, done))
        return await asyncio.wrap_future(done)

    def stats(self) -> EngineStats:
        """The engine's counts now (blocks, running and waiting requests, prefix hits)."""
        return self.engine.stats()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       priority: int = 0, lora: LoraSpec | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing the iterator early (a client gone) aborts it and frees its blocks.

        Raises RequestError for an invalid request and QueueFullError when the waiting queue is full.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine has stopped")
        if self.engine.sleeping:  # the engine thread refuses it too, should it fall asleep meanwhile
            raise EngineAsleepError("the engine is asleep (sleep mode); wake it with POST /wake_up, or send the "
                                    "request to another replica")
        # Tokenizing a long prompt takes milliseconds: do it off the event loop.
        seq = await asyncio.to_thread(self.engine.make_sequence, prompt, params, request_id, priority, lora)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[seq.request_id] = stream
        self._send("add", seq)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(seq.request_id, None)
            if not finished:
                self.abort(seq.request_id)

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def _send(self, command: str, payload: object) -> None:
        self._inbox.put((command, payload))
        self._wakeup.set()

    # --- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # whoever waits on a call must not wait forever
            self._fail_calls()

    def _loop(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            if not self.engine.has_unfinished_requests():
                if self._sleep_when_idle:
                    self._sleep_when_idle = False
                    self.engine.sleep()
                    self._publish_kv_events()
                    log.info("asleep: the last request ended, KV cache released")
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            start = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - a bug must not leave clients hanging
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(exc)
                continue
            if self.metrics is not None:
                self.metrics.observe_step(self.engine.last_batch_size, time.perf_counter() - start)
                for out in outputs:
                    if out.finished:
                        self.metrics.observe_finished(out)
            self._publish_kv_events()
            for out in outputs:
                if out.finished:
                    prompt = self.engine.tokenizer.decode(out.prompt_token_ids) if self.log_prompts else None
                    log_finished(out, prompt)
            self._deliver(outputs)

    def _take_inbox(self) -> Iterator[tuple[str, object]]:
        """The commands in the inbox, oldest first, until it is empty."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self) -> None:
        for command, payload in self._take_inbox():
            if command == "call":
                call, done = payload
                try:
                    result = call()
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    done.set_exception(exc)
                else:
                    self._publish_kv_events()  # a sleep clears the prefix cache: subscribers learn it first
                    done.set_result(result)
            elif isinstance(payload, Sequence):
                try:
                    self.engine.add_sequence(payload)
                except Exception as exc:  # noqa: BLE001 - handed to the request's caller
                    self._push(payload.request_id, exc)
            else:
                self.engine.abort_request(str(payload))

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.engine.block_manager.take_events())

    def _fail_calls(self) -> None:
        for command, payload in self._take_inbox():
            if command == "call":
                payload[1].set_exception(EngineDeadError("the engine has stopped"))

    def _fail_all(self, exc: Exception) -> None:
        # their streams get the error instead of the abort outputs, so a failing step is not retried forever
        for request_id in self.engine.abort_all():
            self._push(request_id, EngineDeadError(f"the engine failed: {exc}"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._push(out.request_id, out)

    def _push(self, request_id: str, item: object) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
