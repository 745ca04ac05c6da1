"""Engine configuration: the settings declared in kvfleet/fleet/engine_settings.py, checked when made."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.fleet.engine_settings import BLOCK_SIZES, EngineSettings
from kvfleet.fleet.sizes import parse_size


@dataclass
class EngineConfig(EngineSettings):
    """What `kvfleet engine` takes (fields, defaults and flags: EngineSettings), with the engine's checks."""

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
        self.check_declared_bounds()
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.lora_modules:
            self.enable_lora = True
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}): "
                             "every adapter in a batch is held in host memory too")
        if self.lora_allowed_dirs and not self.enable_lora:
            raise ValueError("--lora-allowed-dirs needs --enable-lora")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
