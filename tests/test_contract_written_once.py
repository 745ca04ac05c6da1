"""Each engine metric name, header name and Redis key of the fleet contract is written once, in kvfleet.fleet:
no other module of the components or the core package spells one out as a string literal."""

from __future__ import annotations

import ast

from kvfleet.fleet import headers, metrics
from tests.support.paths import ROOT

SCANNED = ("engine", "gateway", "operator", "kernels", "kvfleet")

CONTRACT = ROOT / "kvfleet" / "fleet"
REDIS_HASH_TAG = "kvfleet:{"  # how every Redis key of a fleet starts


def _names(module) -> set[str]:
    return {v for k, v in vars(module).items() if k.isupper() and isinstance(v, str)}


CONTRACT_NAMES = (_names(metrics) | _names(headers)) - {headers.ENGINE_FAULT}


def restated(source: str, path: str) -> list[str]:
    """`path:line: 'literal'` for each string literal that is a contract name or starts a Redis key."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in CONTRACT_NAMES or REDIS_HASH_TAG in node.value:
                found.append(f"{path}:{node.lineno}: {node.value!r}")
    return sorted(found)


def test_no_module_outside_the_contract_restates_a_contract_name() -> None:
    found = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if CONTRACT not in path.parents:
                found += restated(path.read_text(), str(path.relative_to(ROOT)))
    assert found == [], "use the constants in kvfleet.fleet instead:\n" + "\n".join(found)


def test_the_check_sees_metric_names_headers_and_redis_keys() -> None:
    source = ('G = "kvfleet_num_requests_waiting"\n'
              'def f(fleet):\n'
              '    return {"x-kvfleet-priority": 1}, f"kvfleet:{{{fleet}}}:queue"\n'
              'HELP = "sent as x-kvfleet-priority"\n')
    assert restated(source, "m.py") == ["m.py:1: 'kvfleet_num_requests_waiting'",
                                        "m.py:3: 'kvfleet:{'", "m.py:3: 'x-kvfleet-priority'"]
