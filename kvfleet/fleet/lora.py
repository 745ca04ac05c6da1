"""LoRA adapters as the fleet names them, without torch (`kvfleet up` reads them before any engine starts): the
`NAME=PATH` form of vLLM's --lora-modules, and the PEFT directory's config file, whose rank sizes an engine's slots."""

from __future__ import annotations

import json
import re
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_LORAS_DEFAULT = 8  # `kvfleet up`: distinct adapters in one engine's batch unless --max-loras says
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM takes
DEFAULT_MAX_LORA_RANK = 16  # vLLM's and kvfleet's engine's
ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"  # what an adapter's name (a request's `model`) may be
ADAPTER_NAME_RULE = "1-128 letters, digits and . _ : / - (starting with a letter or digit)"


def valid_adapter_name(name: object) -> bool:
    return isinstance(name, str) and re.match(ADAPTER_NAME, name) is not None


def max_lora_rank_for(ranks: list[int]) -> int:
    """The --max-lora-rank that serves adapters of these ranks: the engines' default, or vLLM's next value up."""
    largest = max(ranks, default=1)
    if largest <= DEFAULT_MAX_LORA_RANK:
        return DEFAULT_MAX_LORA_RANK
    for rank in VLLM_MAX_LORA_RANKS:
        if rank >= largest:
            return rank
    raise ValueError(f"an adapter of rank {largest} is over the largest rank engines serve "
                     f"({VLLM_MAX_LORA_RANKS[-1]})")


def parse_lora_module(text: str, flag: str = "--lora-modules") -> tuple[str, str]:
    """`NAME=PATH` as (name, path); ValueError saying what is wrong."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"{flag} takes NAME=PATH (an adapter's name and its directory), not {text[:200]!r}")
    return name, path


def adapter_rank(directory: Path) -> int:
    """The rank `r` in a PEFT adapter's config; ValueError where the file does not say one."""
    try:
        rank = json.loads((directory / ADAPTER_CONFIG).read_text()).get("r")
    except (OSError, ValueError, AttributeError, RecursionError) as err:
        raise ValueError(f"{directory / ADAPTER_CONFIG} is not a readable adapter config: {err}") from None
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{directory / ADAPTER_CONFIG}: r must be a positive whole number, not {rank!r}")
    return rank
