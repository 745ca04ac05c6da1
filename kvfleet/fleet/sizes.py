"""Sizes in bytes as people write them (`512MiB`, `2GiB`, Kubernetes' `1Gi`) and back."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}


def parse_size(text: str | int) -> int:
    """Bytes from an int or a size such as `512MiB`, `2GiB`, `1Gi` or `1.5GB`."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write bytes or a size such as 512MiB or 2GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_size(num_bytes: int) -> str:
    """A byte count for people: `1.50 GiB`, `512.00 MiB`, `12 B`."""
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if num_bytes >= factor:
            return f"{num_bytes / factor:.2f} {unit}"
    return f"{num_bytes} B"
