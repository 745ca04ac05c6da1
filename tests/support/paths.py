"""Where the project's files are, wherever a test file sits in tests/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
DATA = ROOT / "tests" / "data"  # recorded inputs: metrics pages, KV-event captures, manifests
CHART = ROOT / "charts" / "kvfleet"
