"""Waiting for a state, never for an interval: poll until a condition holds, or fail saying what never happened."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(condition: Callable[[], bool], message: str, timeout: float = 30.0) -> float:
    """Polls until condition holds; returns the seconds it took."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(message)
        time.sleep(0.02)
    return time.monotonic() - started
