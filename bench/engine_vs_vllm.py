"""kvfleet's engine against vLLM on the same CPU, one engine at a time, with vLLM's own load generator.

    python -m bench.engine_vs_vllm --dtype bfloat16 --json docs/benchmarks/engine_vs_vllm_bf16.json
    python -m bench.engine_vs_vllm --dtype float32 --json docs/benchmarks/engine_vs_vllm_fp32.json

Engines (each alone on the machine, on kvfleet's converted SmolLM2-135M-Instruct, 1 GiB of KV cache, max_model_len
2048, prefix caching on, every other setting its own default): vLLM in its best CPU settings (both cores bound with
VLLM_CPU_OMP_THREADS_BIND, the Intel OpenMP runtime preloaded: its CPU guide), vLLM as it starts by default (it
keeps one of two cores for its front end), and `kvfleet engine`. Workloads, each by `vllm bench serve` (random
tokens, EOS ignored, after a warm-up pass), in this order:

- short-long: 128-token prompts, 256-token answers, every request at once (decode-bound);
- long-short: 1024-token prompts, 32-token answers, every request at once (prefill-bound);
- prefix: vLLM's prefix_repetition dataset, 8 prefixes of 512 tokens, 128-token suffixes, 64-token answers;
- poisson: the short-long shape at 70 % of vLLM's best request rate on it (measured first, in the same run).

Reports output tokens/s, mean and p99 TTFT and TPOT, peak RSS of the engine's processes, and each figure's ratio
to vLLM's best settings; a chart beside the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench.fleet_procs import get, model_dir
from kvfleet.fleet.cpu_features import CPUINFO, host_cpu_flags
from kvfleet.fleet.engine_settings import EngineSettings
from kvfleet.fleet.ports import free_port
from kvfleet.local.supervisor import Child, kvfleet_command
from kvfleet.local.supervisor import spawn as spawn_child

SERVED = "bench-model"
MAX_MODEL_LEN = 2048
KV_CACHE = "1GiB"
WORKLOADS = {
    "short-long": ["--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "256"],
    "long-short": ["--dataset-name", "random", "--random-input-len", "1024", "--random-output-len", "32"],
    "prefix": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "512",
               "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", "8",
               "--prefix-repetition-output-len", "64"],
    "poisson": ["--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "256"],
}
POISSON_SHARE = 0.7  # of vLLM's best request rate on the same shape
ENGINES = ("vllm-best", "vllm-default", "kvfleet")
FIGURES = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")


@dataclass
class RssWatch:
    """The largest summed RSS of a process and its children, sampled every half second in a thread."""

    pid: int
    peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> RssWatch:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs if p.is_running()))
            except psutil.Error:
                pass


def vllm_install():
    from kvfleet.local.vllm import find_vllm

    return find_vllm()


def start_engine(kind: str, dtype: str, model: Path, log_dir: Path, extra: list[str] | None = None) -> Child:
    """kvfleet's engine or vLLM (kind: vllm-best or vllm-default) on a free port, ready; `extra` flags go to either
    (the LoRA flags are the same in both)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if kind == "kvfleet":
        settings = EngineSettings(model=str(model), max_model_len=MAX_MODEL_LEN, kv_cache_memory=KV_CACHE, dtype=dtype)
        args = ["engine", *settings.to_args(), "--served-model-name", SERVED, "--host", "127.0.0.1",
                "--port", str(port), *(extra or [])]
        child = spawn_child(kind, kvfleet_command(*args), url=url, log_dir=log_dir, env=dict(os.environ))
        child.wait_ready(lambda: get(url + "/ready") is not None, 300.0, poll_s=0.5)
        return child
    from kvfleet.fleet.vllm_serve import kv_cache_space_gib
    from kvfleet.local.vllm import engine_env

    install = vllm_install()
    base = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    if kind == "vllm-best":  # both cores and Intel's OpenMP, as vLLM's CPU guide sets them up
        env = engine_env(install, base, cores=sorted(os.sched_getaffinity(0)), kv_cache_memory=KV_CACHE)
    else:  # what `vllm serve` does when nothing is set but the KV space
        env = {**base, "VLLM_CPU_KVCACHE_SPACE": kv_cache_space_gib(KV_CACHE)}
    argv = [str(install.executable), "serve", str(model), "--served-model-name", SERVED, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching",
            *(extra or [])]
    child = spawn_child(kind, argv, url=url, log_dir=log_dir, env=env)
    child.wait_ready(lambda: get(url + "/health") is not None, 900.0, poll_s=1.0)
    return child


def bench_serve(url: str, model: Path, workload: str, num_prompts: int, rate: float | None, out: Path,
                seed: int, extra: list[str] | None = None) -> dict:
    """One `vllm bench serve` run; its saved result (throughputs, TTFT/TPOT/ITL means and percentiles). `workload`
    names one of WORKLOADS, or is "" with the dataset's flags in `extra`."""
    install = vllm_install()
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(install.executable), "bench", "serve", "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", SERVED, "--tokenizer", str(model),
           *WORKLOADS.get(workload, []), *(extra or []),
           "--num-prompts", str(num_prompts), "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
           "--request-rate", "inf" if rate is None else f"{rate:.4f}", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(out.parent),
           "--result-filename", out.name]
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(out.read_text())
    return {k: result[k] for k in (*FIGURES, "request_throughput", "completed", "failed", "total_input_tokens",
                                   "total_output_tokens", "duration") if k in result} | {"command": shlex.join(cmd)}


def run_engine(kind: str, args: argparse.Namespace, model: Path, work: Path, rates: dict[str, float]) -> dict:
    (work / "logs").mkdir(exist_ok=True)
    child = start_engine(kind, args.dtype, model, work / "logs")
    out: dict = {}
    try:
        with RssWatch(child.proc.pid) as rss:
            bench_serve(child.url, model, "short-long", max(4, args.num_prompts // 8), None,
                        work / f"{kind}-warmup.json", args.seed + 1)
            for workload in args.workloads:
                rate = rates.get(workload) if workload == "poisson" else None
                if workload == "poisson" and rate is None:
                    raise RuntimeError("the poisson workload needs vLLM's best rate: run vllm-best on short-long "
                                       "first")
                out[workload] = bench_serve(child.url, model, workload, args.num_prompts, rate,
                                            work / f"{kind}-{workload}.json", args.seed) | (
                    {"request_rate": rate} if rate else {})
                print(f"{kind:13s} {workload:11s} " + "  ".join(
                    f"{k}={out[workload].get(k, float('nan')):.1f}" for k in FIGURES), flush=True)
                if kind == "vllm-best" and workload == "short-long":
                    rates["poisson"] = POISSON_SHARE * out[workload]["request_throughput"]
        out["peak_rss_mib"] = round(rss.peak / 2**20)
    finally:
        child.stop()
    return out


def ratios(report: dict) -> dict:
    """Each engine's figure ÷ vLLM best's on the same workload."""
    base = report["engines"].get("vllm-best", {})
    out: dict = {}
    for kind, runs in report["engines"].items():
        for workload, run in runs.items():
            if isinstance(run, dict) and workload in base:
                out.setdefault(kind, {})[workload] = {k: round(run[k] / base[workload][k], 3)
                                                      for k in FIGURES if run.get(k) and base[workload].get(k)}
    return out


def table(report: dict) -> str:
    lines = ["| workload | engine | out tok/s | ÷ vLLM best | mean TTFT ms | ÷ | p99 TTFT ms | mean TPOT ms | ÷ "
             "| p99 TPOT ms | peak RSS MiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    r = report["ratios"]
    for workload in report["workloads"]:
        for kind, runs in report["engines"].items():
            run = runs.get(workload)
            if not run:
                continue
            q = r.get(kind, {}).get(workload, {})

            def ratio(figure: str, q: dict = q) -> str:
                return f"{q[figure]:.2f}" if figure in q else "—"

            lines.append(f"| {workload} | {kind} | {run['output_throughput']:.0f} | {ratio('output_throughput')}"
                         f" | {run['mean_ttft_ms']:.0f} | {ratio('mean_ttft_ms')} | {run['p99_ttft_ms']:.0f}"
                         f" | {run['mean_tpot_ms']:.1f} | {ratio('mean_tpot_ms')} | {run['p99_tpot_ms']:.1f}"
                         f" | {runs.get('peak_rss_mib', '')} |")
    return "\n".join(lines)


def chart(report: dict, path: Path) -> None:
    from bench.plotting import finish, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    kinds = list(report["engines"])
    for ax, (figure, label) in zip(axes, (("output_throughput", "output tokens/s"), ("mean_ttft_ms", "mean TTFT, ms"),
                                          ("mean_tpot_ms", "mean TPOT, ms")), strict=True):
        width = 0.8 / len(kinds)
        for i, kind in enumerate(kinds):
            values = [report["engines"][kind].get(w, {}).get(figure, 0) for w in report["workloads"]]
            ax.bar([x + i * width for x in range(len(report["workloads"]))], values, width, label=kind)
        ax.set_xticks([x + width * (len(kinds) - 1) / 2 for x in range(len(report["workloads"]))],
                      report["workloads"])
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle(f"kvfleet engine vs vLLM on {report['machine']['cpu']}, {report['dtype']}")
    finish(fig, path)


def machine() -> dict:
    flags = host_cpu_flags() or frozenset()
    try:
        info = CPUINFO.read_text()
    except OSError:
        info = ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.processor())
    return {"cpu": name, "cores": len(os.sched_getaffinity(0)), "amx_bf16": "amx_bf16" in flags,
            "avx512_bf16": "avx512_bf16" in flags}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"some of {', '.join(ENGINES)}, in this order")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"some of {', '.join(WORKLOADS)}")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="the report; the chart goes beside it (.png)")
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    kinds = [k for k in args.engines.split(",") if k]
    if bad := [k for k in kinds if k not in ENGINES] + [w for w in args.workloads if w not in WORKLOADS]:
        p.error(f"unknown engine or workload: {', '.join(bad)}")
    model = model_dir(args.model)
    work = Path(tempfile.mkdtemp(prefix="kvfleet-engine-vs-vllm-"))
    rates: dict[str, float] = {}
    report = {"command": shlex.join(["python", "-m", "bench.engine_vs_vllm", *(argv or sys.argv[1:])]),
              "machine": machine(), "dtype": args.dtype, "model": args.model, "max_model_len": MAX_MODEL_LEN,
              "kv_cache": KV_CACHE, "num_prompts": args.num_prompts, "workloads": args.workloads,
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "engines": {}}
    for kind in kinds:
        report["engines"][kind] = run_engine(kind, args, model, work, rates)
    report["ratios"] = ratios(report)
    report["table"] = table(report)
    print(report["table"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        chart(report, args.json.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
