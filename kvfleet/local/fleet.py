"""`kvfleet up`: a whole fleet on one machine: an embedded Redis, N engine processes and a gateway; with several
models (`--model A --model B`), N engines of each behind the one gateway, each model its own fleet there.

A model is resolved (and converted, the first time) once here, so N engines never race to write the cache.
An engine that exits is started again on the same port, as a kubelet restarts a container (restartPolicy Always),
after a back-off that grows while it keeps failing; the gateway routes around it meanwhile.
Ctrl-C or SIGTERM stops the gateway first (no new requests), then the engines (they drain), then Redis.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet.fleet.engine_settings import LOCAL_FLEET, EngineSettings
from kvfleet.fleet.lora import ADAPTER_CONFIG, MAX_LORAS_DEFAULT, adapter_rank, max_lora_rank_for, parse_lora_module
from kvfleet.fleet.ports import free_ports, port_is_free
from kvfleet.fleet.vllm_serve import HEALTH_PATH, serve_args
from kvfleet.gateway.models.routes import check_model_name
from kvfleet.local.redis_server import RedisServer
from kvfleet.local.supervisor import Child, Supervisor, kvfleet_command, previous_log
from kvfleet.local.vllm import core_groups, ensure_vllm, local_dtype_args
from kvfleet.local.vllm import engine_env as vllm_engine_env

# The engines' shared token (issue 13): `kvfleet engine --api-key` and `kvfleet gateway --engine-api-key` read it.
ENGINE_API_KEY_ENV = "KVFLEET_ENGINE_API_KEY"
RUNTIMES = ("kvfleet", "vllm")


# A kubelet's CrashLoopBackOff (10 s doubling to 5 min), but the first restart is at once; an engine that ran this long
# since its last start counts as healthy again (its back-off starts over).
RESTART_BACKOFF_S = (0.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0)
RESTART_RESET_AFTER_S = 600.0


def restart_delay_s(failures: int) -> float:
    """Seconds to wait before starting an engine again after its `failures`-th exit in a row (1 = the first)."""
    return RESTART_BACKOFF_S[min(max(failures, 1), len(RESTART_BACKOFF_S)) - 1]


@dataclass
class EngineLaunch:
    """What started an engine (to start it again after it exits) and its restart record."""

    argv: list[str]
    env: dict[str, str]
    started_at: float
    restarts: int = 0  # in all
    failures: int = 0  # exits in a row (the back-off's count)
    due_at: float | None = None  # when the next start is due, while it is down


def engine_env(base: dict[str, str], token: str) -> dict[str, str]:
    """The environment of a local fleet's engines and gateway: the run's token replaces any inherited one."""
    return {**base, ENGINE_API_KEY_ENV: token}


@dataclass
class FleetSpec:
    engines: int = 2
    model: str = "smollm2-135m-instruct"
    more_models: tuple[str, ...] = ()  # further models, each served by its own `engines` engines (a fleet each)
    host: str = "127.0.0.1"
    port: int = 8080
    # A laptop's engines (kvfleet/fleet/engine_settings.py says why they differ from the engine's defaults).
    max_model_len: int | None = LOCAL_FLEET.max_model_len
    kv_cache_memory: str | None = LOCAL_FLEET.kv_cache_memory
    max_num_seqs: int = LOCAL_FLEET.max_num_seqs
    fleet: str = "local"
    routing: str = "kvfleet"
    runtime: str = "kvfleet"  # or "vllm": vLLM engines (kvfleet/local/vllm.py) behind the same gateway
    vllm: str | None = None  # the `vllm` to run (default: $KVFLEET_VLLM, else the managed install)
    engine_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    ready_timeout_s: float = 600.0
    loras: tuple[str, ...] = ()  # NAME=PATH: LoRA adapters every engine serves (`--lora`)
    max_loras: int | None = None  # distinct adapters in a batch (default: all of them, at most MAX_LORAS_DEFAULT)

    def __post_init__(self) -> None:
        if self.runtime not in RUNTIMES:
            raise ValueError(f"--runtime must be one of {', '.join(RUNTIMES)}, not {self.runtime!r}")
        if self.vllm and self.runtime != "vllm":
            raise ValueError("--vllm names the vLLM to run with --runtime vllm; add --runtime vllm")
        if not 1 <= self.engines <= 64:
            raise ValueError(f"--engines must be between 1 and 64, not {self.engines}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be a TCP port, not {self.port}")
        served = [served_name(m)[0] for m in self.models]
        if len(served) > 1:  # the gateway routes by these names
            for name in served:
                check_model_name(name, "--model")
        if len(set(served)) != len(served):
            raise ValueError(f"each model name once (NAME=MODEL serves MODEL under another name): {', '.join(served)}")
        if len(self.models) * self.engines > 64:
            raise ValueError(f"{len(self.models)} models x {self.engines} engines is more than 64 engines")
        self._check_loras()

    def _check_loras(self) -> None:
        """Every --lora a NAME=PATH whose directory holds an adapter, before anything starts."""
        if self.max_loras is not None and (not self.loras or self.max_loras < 1):
            raise ValueError("--max-loras needs --lora adapters, and is at least 1")
        if self.loras and len(self.models) > 1:
            raise ValueError("--lora adapters belong to one base model: give one --model")
        names = []
        for entry in self.loras:
            name, path = parse_lora_module(entry, "--lora")
            if not (Path(path) / ADAPTER_CONFIG).is_file():
                raise ValueError(f"--lora {entry[:200]!r}: {path} holds no {ADAPTER_CONFIG} (a PEFT adapter's "
                                 "directory has it and adapter_model.safetensors)")
            names.append(name)
        if len(set(names)) != len(names):
            raise ValueError(f"each --lora name once: {', '.join(names)}")
        max_lora_rank_for([adapter_rank(Path(parse_lora_module(e)[1])) for e in self.loras])

    def lora_args(self) -> list[str]:
        """The engine flags that serve the adapters (the same in `kvfleet engine` and `vllm serve`)."""
        if not self.loras:
            return []
        adapters = [parse_lora_module(e) for e in self.loras]
        rank = max_lora_rank_for([adapter_rank(Path(path)) for _, path in adapters])
        return ["--enable-lora", "--max-loras", str(self.max_loras or min(len(adapters), MAX_LORAS_DEFAULT)),
                "--max-lora-rank", str(rank),
                "--lora-modules", *(f"{name}={Path(path).resolve()}" for name, path in adapters)]

    @property
    def models(self) -> tuple[str, ...]:
        return (self.model, *self.more_models)


def served_name(entry: str) -> tuple[str, str]:
    """`--model NAME=MODEL` -> (NAME, MODEL): MODEL served as NAME; a plain MODEL is served as itself. ValueError
    for a name the gateway would refuse (it says why), before anything starts."""
    name, sep, model = entry.partition("=")
    if sep and name.strip() and model.strip() and "/" not in name:
        return check_model_name(name, f"--model {entry[:80]!r}"), model.strip()
    return entry, entry


def threads_per_engine(engines: int, cpus: int | None = None) -> int:
    """Engines share the machine's cores instead of each spawning a thread per core."""
    return max(1, (cpus or os.cpu_count() or 1) // engines)


class LocalFleet:
    def __init__(self, spec: FleetSpec):
        self.spec = spec
        self.run_dir = Path(tempfile.mkdtemp(prefix="kvfleet-up-"))
        self.procs = Supervisor(self.run_dir)
        self.redis: RedisServer | None = None
        self.engines: list[Child] = []
        self.launches: dict[str, EngineLaunch] = {}  # by engine name
        self.gateway: Child | None = None
        # A new token per run: only this run's gateway may call its engines, even on a shared machine.
        self.engine_api_key = secrets.token_urlsafe(32)

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    def start(self) -> None:
        s = self.spec
        if not port_is_free(s.host, s.port):
            raise ValueError(f"port {s.port} on {s.host} is in use; choose another with --port")
        model_dirs = {served_name(m)[0]: self._resolve_model(served_name(m)[1]) for m in s.models}
        token_file = self.run_dir / "engine-api-key"  # for calling an engine directly (curl -H @...)
        token_file.touch(mode=0o600)
        token_file.write_text(f"Authorization: Bearer {self.engine_api_key}\n")
        vllm = ensure_vllm(s.vllm, log=say) if s.runtime == "vllm" else None
        dtype_args = [] if vllm is None else local_dtype_args(vllm, s.engine_args)
        if dtype_args:
            say(f"kvfleet up: vLLM runs in {dtype_args[-1]}: this CPU has no bfloat16 instructions (AVX-512 BF16, "
                "AMX), where vLLM would emulate its bfloat16 ~3x slower (--engine-arg=--dtype=... to choose)")
        self.redis = RedisServer().start()
        env = engine_env(dict(os.environ), self.engine_api_key)
        env.setdefault("OMP_NUM_THREADS", str(threads_per_engine(s.engines * len(s.models))))
        total = s.engines * len(model_dirs)
        cores = core_groups(total)
        served: list[tuple[str, Child]] = []
        ports = iter(free_ports(total, avoid={s.port}))  # together, none twice, not the gateway's
        for m, (model, model_dir) in enumerate(model_dirs.items()):
            for i in range(s.engines):
                port, name = next(ports), f"engine-{len(served)}" if len(s.models) == 1 else f"engine-{m}.{i}"
                url = f"http://127.0.0.1:{port}"
                if vllm is None:
                    settings = EngineSettings(model=str(model_dir), max_model_len=s.max_model_len,
                                              kv_cache_memory=s.kv_cache_memory, max_num_seqs=s.max_num_seqs)
                    args = ["engine", *settings.to_args(), "--served-model-name", model, "--host", "127.0.0.1",
                            "--port", str(port), *s.lora_args(), *s.engine_args]
                    engine = self._spawn(name, kvfleet_command(*args), url, env)
                else:
                    argv = [str(vllm.executable), "serve", *serve_args(
                        str(model_dir), model, port, host="127.0.0.1", events_port=0, max_model_len=s.max_model_len,
                        max_num_seqs=s.max_num_seqs, extra=[*s.lora_args(), *s.engine_args, *dtype_args])]
                    engine = self._spawn(name, argv, url, vllm_engine_env(
                        vllm, env, cores=cores[len(served)], kv_cache_memory=s.kv_cache_memory,
                        api_key=self.engine_api_key))
                served.append((model, engine))
        self.engines = [engine for _, engine in served]
        for engine in self.engines:
            self._wait_ready(engine, "/ready" if vllm is None else HEALTH_PATH)
        # the engines' tokenizer: prompts are routed by the blocks the engines report
        if len(s.models) == 1:
            routes = [flag for _, e in served for flag in ("--engine", e.url)]
            routes += ["--fleet", s.fleet, "--tokenizer", str(next(iter(model_dirs.values())))]
        else:  # one fleet per model, by the request's `model`
            routes = [flag for model, e in served for flag in ("--engine", f"{model}={e.url}")]
            routes += [flag for model, d in model_dirs.items() for flag in ("--tokenizer", f"{model}={d}")]
        # the Batch API (OpenAI's /v1/files and /v1/batches), its files in the run's directory beside the logs
        args = ["gateway", "--host", s.host, "--port", str(s.port), "--redis-url", self.redis.url,
                "--routing", s.routing, "--batch-dir", str(self.run_dir / "batches"), *routes, *s.gateway_args]
        self.gateway = self._spawn("gateway", kvfleet_command(*args), self.url, env)
        self._wait_ready(self.gateway, "/ready")  # with Envoy: once its endpoint picker listens

    @staticmethod
    def _resolve_model(model: str) -> Path:
        from kvfleet.engine.model_files import resolve_model

        say(f"kvfleet up: preparing model {model}")
        return resolve_model(model)

    def _spawn(self, name: str, argv: list[str], url: str, env: dict[str, str]) -> Child:
        # engine-0, engine-1, ... form one group: they stop together, after the gateway.
        if name.startswith("engine-"):
            self.launches[name] = EngineLaunch(argv, env, time.monotonic())
        return self.procs.start(name, argv, url=url, env=env, group=name.split("-")[0])

    def restart_exited(self, now: float | None = None) -> list[str]:
        """Start again each engine that has exited and whose back-off has passed (on its port, with its argv and
        environment); the names of those started. The first exit of an engine is reported."""
        now = time.monotonic() if now is None else now
        started = []
        for k, engine in enumerate(self.engines):
            launch = self.launches.get(engine.name)
            if launch is None or engine.poll() is None:
                continue
            if launch.due_at is None:  # seen down for the first time
                ran_s = now - launch.started_at
                launch.failures = 1 if ran_s >= RESTART_RESET_AFTER_S else launch.failures + 1
                launch.due_at = now + restart_delay_s(launch.failures)
                print(f"kvfleet up: {engine.name} exited with {engine.returncode} after {ran_s:.0f} s (see "
                      f"{engine.log_path}); the gateway routes around it; starting it again in "
                      f"{launch.due_at - now:.0f} s", file=sys.stderr, flush=True)
            if now < launch.due_at:
                continue
            launch.due_at, launch.started_at = None, now
            launch.restarts += 1
            self.engines[k] = self.procs.replace(engine, launch.argv, env=launch.env)
            started.append(engine.name)
        return started

    def _wait_ready(self, child: Child, path: str) -> None:
        child.wait_ready(path, self.spec.ready_timeout_s, poll_s=0.2)
        say(f"kvfleet up: {child.name} ready at {child.url}")

    def watch(self, stop_requested) -> int:
        """Until a signal asks to stop (0) or the gateway dies (1); an engine that exits is started again."""
        while not stop_requested():
            if self.gateway.poll() is not None:
                print(f"kvfleet up: the gateway exited with {self.gateway.returncode}:\n{self.gateway.tail()}",
                      file=sys.stderr)
                return 1
            for name in self.restart_exited():
                say(f"kvfleet up: {name} started again (restart {self.launches[name].restarts}; its last run's log is "
                    f"{self.run_dir / previous_log(Path(name + '.log'))})")
            time.sleep(0.2)
        return 0

    def stop(self, timeout_s: float = 30.0) -> None:
        self.procs.stop(timeout_s)  # the gateway (no new requests), then the engines together (they drain)
        if self.redis is not None:
            self.redis.stop()


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _StopDuringStart(Exception):
    """A signal came while the fleet was starting."""


def run_until_signal(fleet, banner) -> int:
    """Start a local fleet, print banner(fleet), serve until SIGINT/SIGTERM or a failure, then stop it all.
    `fleet` has start(), watch(stop_requested) and stop(), as LocalFleet and LocalCluster do. A signal while it
    starts ends the start there (vLLM engines take minutes to be ready, or never are)."""
    stopping = {"now": False, "started": False}

    def request_stop(signum: int, frame) -> None:  # noqa: ANN001 - signal handler signature
        stopping["now"] = True
        if not stopping["started"]:
            raise _StopDuringStart

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        fleet.start()
        stopping["started"] = True
        if stopping["now"]:
            return 0
        print(banner(fleet), file=sys.stderr, flush=True)
        return fleet.watch(lambda: stopping["now"])
    except _StopDuringStart:
        return 0
    except RuntimeError as err:
        print(f"kvfleet up: {err}", file=sys.stderr)
        return 1
    finally:
        stopping["started"] = True  # a second signal must not break the stop
        print("kvfleet up: stopping", file=sys.stderr, flush=True)
        fleet.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(spec: FleetSpec) -> int:
    def banner(fleet: LocalFleet) -> str:
        body = json.dumps({"model": served_name(spec.model)[0], "messages": [{"role": "user", "content": "Hi!"}]})
        fleets = f"fleet {spec.fleet!r}" if len(spec.models) == 1 else "one fleet per model, chosen by `model`"
        return (f"\nkvfleet fleet is up: {fleet.url}  ({spec.engines} engine(s) of {' and of '.join(spec.models)}, "
                f"Redis {fleet.redis.url}, {fleets})\n"
                f"  curl {fleet.url}/v1/chat/completions -H 'content-type: application/json' -d '{body}'\n"
                f"  batches: OpenAI's Batch API at {fleet.url}/v1/files and /v1/batches (client.batches.create)\n"
                f"  metrics: {fleet.url}/metrics   logs: {fleet.run_dir}\n"
                f"  engines answer /v1/* only with the run's token: curl -H @{fleet.run_dir}/engine-api-key ...\n"
                "Ctrl-C stops everything.")

    return run_until_signal(LocalFleet(spec), banner)
