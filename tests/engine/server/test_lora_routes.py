"""LoRA adapters over the engine's HTTP API, as a vLLM user drives them with the `openai` client: a request names an
adapter as its model and gets that adapter's answer; /v1/models lists adapters with their parent; adapters load and
unload at run time behind the engine token, only from the allowed directories. Every hostile load is a 4xx that says
what to change, keeps nothing, and leaves the other requests alone."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from kvfleet.engine.tokenizer import Tokenizer
from tests.conftest import _engine_args, _launch, _wait_ready, free_port, start_engine_server, stop_process
from tests.support.lora_adapters import make_adapter, merged_greedy

TOKEN = "lora-engine-token"
PROMPT = [1, 422, 2014, 314, 260, 3458, 282]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def dirs(tiny_model_dir: Path, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-api")
    allowed = root / "allowed"
    found = {"sql": make_adapter(tiny_model_dir, root / "served" / "sql", seed=1, rank=8, std=0.2),
             "poet": make_adapter(tiny_model_dir, root / "served" / "poet", seed=2, rank=4, std=0.2),
             "late": make_adapter(tiny_model_dir, allowed / "late", seed=3, rank=8, std=0.2),
             "outside": make_adapter(tiny_model_dir, root / "outside", seed=4, rank=8, std=0.2),
             "wide": make_adapter(tiny_model_dir, allowed / "wide", seed=5, rank=32),
             "other-base": make_adapter(smollm2_dir, allowed / "other-base", seed=6, rank=4,
                                        targets=("q_proj",))}
    corrupt = make_adapter(tiny_model_dir, allowed / "corrupt", seed=7, rank=4, targets=("q_proj",))
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    found["corrupt"] = corrupt
    unknown = make_adapter(tiny_model_dir, allowed / "unknown-target", seed=8, rank=4, targets=("q_proj",))
    config = json.loads((unknown / "adapter_config.json").read_text())
    (unknown / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "lm_head"]}))
    found["unknown-target"] = unknown
    (allowed / "escape").symlink_to(root / "outside")
    found["escape"] = allowed / "escape"
    found["traversal"] = allowed / ".." / "outside"
    (allowed / "loop").symlink_to(allowed / "loop")
    found["loop"] = allowed / "loop"
    found["allowed"] = allowed
    return found


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, dirs: dict[str, Path]) -> str:
    port = free_port()
    extra = ("--lora-modules", f"sql={dirs['sql']}", f"poet={dirs['poet']}", "--max-loras", "2",
             "--lora-allowed-dirs", str(dirs["allowed"]), "--max-num-seqs", "8", "--kv-cache-memory", "16MiB")
    os.environ["KVFLEET_ENGINE_API_KEY"] = TOKEN
    try:
        proc = _launch(_engine_args(tiny_model_dir, port, extra), port, "engine")
    finally:
        del os.environ["KVFLEET_ENGINE_API_KEY"]
    _wait_ready(proc, 180.0)
    yield proc.url
    stop_process(proc)


@pytest.fixture(scope="module")
def base_name(tiny_model_dir: Path) -> str:
    return str(tiny_model_dir)


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)


def post(url: str, path: str, body: object, token: str = TOKEN) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=60)


def answer(url: str, model: str) -> openai.types.Completion:
    return client(url).completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})


def expected_text(model_dir: Path, adapter: Path | None) -> str:
    return Tokenizer(model_dir).decode(merged_greedy(model_dir, adapter, [PROMPT], NEW_TOKENS)[0])


def test_each_adapter_answers_by_its_name_with_its_own_weights(engine: str, tiny_model_dir: Path, base_name: str,
                                                               dirs: dict[str, Path]) -> None:
    with ThreadPoolExecutor(6) as pool:  # the base model and both adapters in the same steps
        replies = list(pool.map(lambda model: answer(engine, model), [base_name, "sql", "poet"] * 2))
    for reply, (model, adapter) in zip(replies, [(base_name, None), ("sql", dirs["sql"]),
                                                 ("poet", dirs["poet"])] * 2, strict=True):
        assert reply.model == model  # as vLLM answers: the adapter's name
        assert reply.choices[0].text == expected_text(tiny_model_dir, adapter), model
    assert len({r.choices[0].text for r in replies}) == 3


def test_models_lists_the_adapters_with_their_parent(engine: str, base_name: str, dirs: dict[str, Path]) -> None:
    cards = {m.id: m for m in client(engine).models.list().data}
    assert set(cards) == {base_name, "sql", "poet"}
    assert cards["sql"].parent == base_name and cards["sql"].root == str(dirs["sql"])


def test_an_adapter_loaded_at_run_time_answers_and_unloaded_is_gone(engine: str, tiny_model_dir: Path,
                                                                    dirs: dict[str, Path]) -> None:
    loaded = post(engine, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(dirs["late"])})
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'late' added successfully."
    assert "late" in {m.id for m in client(engine).models.list().data}
    assert answer(engine, "late").choices[0].text == expected_text(tiny_model_dir, dirs["late"])
    again = post(engine, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(dirs["late"])})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    assert post(engine, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError) as gone:
        answer(engine, "late")
    assert "does not exist" in gone.value.message
    unknown = post(engine, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert unknown.status_code == 404 and "cannot be found" in unknown.json()["error"]["message"]


@pytest.mark.parametrize(("body", "says"), [
    (lambda d: {"lora_name": "x", "lora_path": str(d["outside"])}, "outside the directories"),
    (lambda d: {"lora_name": "x", "lora_path": str(d["traversal"])}, "outside the directories"),
    (lambda d: {"lora_name": "x", "lora_path": str(d["escape"])}, "outside the directories"),  # a symlink out
    (lambda d: {"lora_name": "x", "lora_path": str(d["wide"])}, "--max-lora-rank"),
    (lambda d: {"lora_name": "x", "lora_path": str(d["other-base"])}, "another base model"),
    (lambda d: {"lora_name": "x", "lora_path": str(d["corrupt"])}, "not a readable safetensors file"),
    (lambda d: {"lora_name": "x", "lora_path": str(d["unknown-target"])}, "not projections of a Llama layer"),
    (lambda d: {"lora_name": "x", "lora_path": str(d["allowed"] / "missing")}, "has no adapter_config.json"),
    (lambda d: {"lora_name": "x", "lora_path": str(d["allowed"]) + "/\x00"}, "NUL byte"),
    (lambda d: {"lora_name": "x", "lora_path": str(d["loop"])}, "cannot be resolved"),  # a symlink to itself
    (lambda d: {"lora_name": "x", "lora_path": str(d["allowed"] / ("n" * 300))}, "cannot be read"),  # a name too long
    (lambda d: {"lora_name": "sql", "lora_path": str(d["late"])}, "already loaded"),
    (lambda d: {"lora_name": "../../etc", "lora_path": str(d["late"])}, "an adapter's name is"),
    (lambda d: {"lora_name": "x" * 300, "lora_path": str(d["late"])}, "lora_name"),
    (lambda d: {"lora_name": "x"}, "lora_path"),
    (lambda d: {"lora_name": 7, "lora_path": str(d["late"])}, "lora_name"),
    (lambda d: ["lora_name"], "body"),
    (lambda d: {"lora_name": "x", "lora_path": str(d["late"]), "pinned": "yes"}, "pinned"),
])
def test_a_hostile_load_is_a_400_that_says_what_to_change_and_keeps_nothing(engine: str, base_name: str,
                                                                           dirs: dict[str, Path], body,
                                                                           says: str) -> None:
    refused = post(engine, "/v1/load_lora_adapter", body(dirs))
    assert refused.status_code == 400, refused.text
    assert says in refused.json()["error"]["message"]
    assert {m.id for m in client(engine).models.list().data} == {base_name, "sql", "poet"}


def test_a_pinned_adapter_is_listed_so_and_pins_stop_at_the_host_memory_it_has(engine: str,
                                                                               dirs: dict[str, Path]) -> None:
    """--max-cpu-loras is 2 here (--max-loras'): two pins fit, a third is refused and keeps nothing."""
    for name in ("pin-a", "pin-b"):
        pinned = post(engine, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(dirs["late"]),
                                                        "pinned": True})
        assert pinned.status_code == 200, pinned.text
    cards = {m.id: m for m in client(engine).models.list().data}
    assert cards["pin-a"].model_extra.get("pinned") is True and "pinned" not in cards["sql"].model_extra
    third = post(engine, "/v1/load_lora_adapter", {"lora_name": "pin-c", "lora_path": str(dirs["late"]),
                                                   "pinned": True})
    assert third.status_code == 400 and "--max-cpu-loras" in third.json()["error"]["message"]
    assert "pin-c" not in {m.id for m in client(engine).models.list().data}
    assert answer(engine, "pin-a").choices[0].text == answer(engine, "pin-b").choices[0].text
    for name in ("pin-a", "pin-b"):
        assert post(engine, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


def test_the_base_models_name_cannot_be_taken(engine: str, base_name: str, dirs: dict[str, Path]) -> None:
    refused = post(engine, "/v1/load_lora_adapter", {"lora_name": base_name, "lora_path": str(dirs["late"])})
    assert refused.status_code == 400 and "base model's name" in refused.json()["error"]["message"]


def test_loading_needs_the_engine_token(engine: str, dirs: dict[str, Path]) -> None:
    body = {"lora_name": "late", "lora_path": str(dirs["late"])}
    assert post(engine, "/v1/load_lora_adapter", body, token="wrong").status_code == 401
    assert post(engine, "/v1/unload_lora_adapter", {"lora_name": "sql"}, token="wrong").status_code == 401
    assert "late" not in {m.id for m in client(engine).models.list().data}


def test_a_load_storm_leaves_the_engine_serving(engine: str, base_name: str, dirs: dict[str, Path]) -> None:
    names = [f"storm-{i}" for i in range(16)]
    with ThreadPoolExecutor(8) as pool:
        loads = list(pool.map(lambda n: post(engine, "/v1/load_lora_adapter",
                                             {"lora_name": n, "lora_path": str(dirs["late"])}), names))
        served = pool.submit(answer, engine, base_name)
        assert served.result().choices[0].finish_reason == "length"
    assert [r.status_code for r in loads] == [200] * len(names)
    assert {"storm-3", "storm-15"} <= {m.id for m in client(engine).models.list().data}
    assert answer(engine, "storm-7").choices[0].text == answer(engine, "storm-8").choices[0].text
    for name in names:
        assert post(engine, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


def test_the_lora_gauge_has_vllms_labels(engine: str) -> None:
    metrics = httpx.get(f"{engine}/metrics", timeout=10).text
    line = next(line for line in metrics.splitlines() if line.startswith("kvfleet_lora_requests_info{"))
    assert 'max_lora="2"' in line and "running_lora_adapters=" in line and "waiting_lora_adapters=" in line


def test_an_engine_without_lora_says_how_to_turn_it_on(tiny_model_dir: Path, dirs: dict[str, Path]) -> None:
    proc, url = start_engine_server(tiny_model_dir)
    try:
        refused = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(dirs["sql"])})
        assert refused.status_code == 400 and "--enable-lora" in refused.json()["error"]["message"]
        unknown = httpx.post(f"{url}/v1/completions", json={"model": "sql", "prompt": "hi", "max_tokens": 1})
        assert unknown.status_code == 404
    finally:
        stop_process(proc)
