"""Each engine and InferenceFleet setting has one default: the engine's flags, EngineConfig, the declaration, the CRD,
the spec parser, AutoscalingPolicy and the contexts' profiles agree, and to_args() reads back as the same settings."""

from __future__ import annotations

import argparse
import dataclasses
import os
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfleet.cli import build_parser
from kvfleet.engine.cli_args import add_engine_args, engine_config_from_args
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.model_files import DEFAULT_MODEL as ENGINE_DEFAULT_MODEL
from kvfleet.fleet.engine_settings import (
    DEFAULT_MODEL,
    DTYPES,
    ENGINE_API_KEY_ENV,
    FLEET_MAX_MODEL_LEN,
    LOCAL_CLUSTER,
    LOCAL_FLEET,
    EngineSettings,
    crd_fields,
    declared,
    default_of,
    flag_fields,
    flag_name,
)
from kvfleet.local.cluster import default_fleet
from kvfleet.local.fleet import FleetSpec as LocalFleetSpec
from kvfleet.operator.autoscaler import AutoscalingPolicy
from kvfleet.operator.crd import build_crd
from kvfleet.operator.fleet_fields import AUTOSCALING_ENABLED, AUTOSCALING_FIELDS, SPEC_FIELDS
from kvfleet.operator.fleet_spec import FleetEngineSettings, FleetSpec, InvalidSpec, parse_fleet
from kvfleet.operator.warm_pool_spec import WarmPool
from tests.support.paths import CHART

SPEC_SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]

MINIMAL = {"model": "m"}


def engine_parser() -> argparse.ArgumentParser:
    with mock.patch.dict(os.environ):
        for f in flag_fields():  # a token or a dtype in the test's environment would be the flag's default
            if declared(f).env:
                os.environ.pop(declared(f).env, None)
        parser = argparse.ArgumentParser()
        add_engine_args(parser)
    return parser


def test_the_flags_defaults_are_engineconfigs_and_the_declarations() -> None:
    parsed = engine_parser().parse_args([])
    config = EngineConfig()
    for f in flag_fields():
        assert getattr(parsed, f.name) == getattr(config, f.name) == default_of(f), f.name
    assert engine_config_from_args(parsed) == config
    assert DEFAULT_MODEL == ENGINE_DEFAULT_MODEL


def test_every_flag_is_declared_and_every_setting_is_a_flag_or_says_why_not() -> None:
    options = {a.option_strings[0] for a in engine_parser()._actions if a.option_strings and a.dest != "help"}
    assert options == {flag_name(f) for f in flag_fields()}
    assert [f.name for f in dataclasses.fields(EngineConfig)] == [f.name for f in dataclasses.fields(EngineSettings)]
    assert {f.name for f in dataclasses.fields(EngineSettings)} - {f.name for f in flag_fields()} == {
        "static_batching"}


def test_the_crds_engine_defaults_are_the_parsers() -> None:
    engine_schema = SPEC_SCHEMA["properties"]["engine"]["properties"]
    parsed = parse_fleet("f", "ns", MINIMAL).engine
    assert parsed == FleetEngineSettings()
    assert {f.name for f in dataclasses.fields(FleetEngineSettings)} == {f.name for f, _ in crd_fields()} | {
        "extra_args"}
    for f, crd in crd_fields():
        assert engine_schema[crd.name].get("default") == getattr(parsed, f.name), crd.name
    # The one deliberate difference: a fleet's pods get a fixed context length, the engine alone the model's.
    assert parsed.max_model_len == FLEET_MAX_MODEL_LEN and EngineConfig().max_model_len is None
    assert parsed.max_num_seqs == EngineConfig().max_num_seqs and parsed.block_size == EngineConfig().block_size


def test_the_crds_autoscaling_and_spec_defaults_are_the_parsers_and_the_policys() -> None:
    auto_schema = SPEC_SCHEMA["properties"]["autoscaling"]["properties"]
    fleet = parse_fleet("f", "ns", MINIMAL)
    # The structured fields: sloClasses defaults from kvfleet/fleet/slo.py, capacity has no default (absent: the pods
    # measure theirs); both in tests/operator/test_slo_classes.py
    assert set(auto_schema) == {f.name for f in (AUTOSCALING_ENABLED, *AUTOSCALING_FIELDS)} | {"sloClasses",
                                                                                                  "capacity",
                                                                                                  "warmPool"}
    assert "default" not in auto_schema["capacity"] and fleet.autoscaling.capacity is None
    # warmPool: absent is no pool; its fields' defaults are WarmPool's (tests/operator/test_warm_pool.py)
    warm = auto_schema["warmPool"]["properties"]
    assert fleet.warm_pool is None and warm["replicas"]["default"] == 0
    assert warm["wakeSeconds"]["default"] == WarmPool().wake_s
    for f in AUTOSCALING_FIELDS:
        assert auto_schema[f.name]["default"] == getattr(fleet.autoscaling, f.attr) == getattr(
            AutoscalingPolicy(), f.attr), f.name
    default_fleet_spec = FleetSpec("f", "ns", "m")
    assert auto_schema["enabled"]["default"] == fleet.autoscaling_enabled == default_fleet_spec.autoscaling_enabled
    for f in SPEC_FIELDS:
        assert SPEC_SCHEMA["properties"][f.name]["default"] == getattr(fleet, f.attr) == getattr(
            default_fleet_spec, f.attr), f.name


def _bounded_fields() -> list[tuple[str, str, float, float, bool]]:
    """(section, field, minimum, maximum, integer) for each bounded field of the CRD's spec."""
    out = [("engine", name, s["minimum"], s["maximum"], s["type"] == "integer")
           for name, s in SPEC_SCHEMA["properties"]["engine"]["properties"].items() if "minimum" in s]
    out += [("autoscaling", f.name, f.minimum, f.maximum, f.kind == "integer") for f in AUTOSCALING_FIELDS
            if f.minimum is not None]  # booleans have no bounds
    out += [("", f.name, f.minimum, f.maximum, True) for f in SPEC_FIELDS]
    return out


@pytest.mark.parametrize(("section", "name", "low", "high", "integer"), _bounded_fields())
def test_the_parser_accepts_exactly_the_crds_bounds(section: str, name: str, low: float, high: float,
                                                     integer: bool) -> None:
    def spec(value: float) -> dict:
        # A roomy replica range, so a minReplicas or maxReplicas edge is judged on its own bounds.
        fields = {"minReplicas": 0, "maxReplicas": 1000, name: value} if section == "autoscaling" else {name: value}
        return {**MINIMAL, section: fields} if section else {**MINIMAL, **fields}

    step = 1 if integer else (high - low) / 1000 or 0.001
    for inside in (low, high):
        parse_fleet("f", "ns", spec(inside))
    for outside in (low - step, high + step):
        with pytest.raises(InvalidSpec, match=name):
            parse_fleet("f", "ns", spec(outside))


def test_the_contexts_defaults_come_from_their_profiles() -> None:
    up = build_parser().parse_args(["up"])
    assert (up.max_num_seqs, up.max_model_len, up.kv_cache_memory) == (
        LOCAL_FLEET.max_num_seqs, LOCAL_FLEET.max_model_len, LOCAL_FLEET.kv_cache_memory)
    local = LocalFleetSpec()
    assert (local.max_num_seqs, local.max_model_len, local.kv_cache_memory) == (
        LOCAL_FLEET.max_num_seqs, LOCAL_FLEET.max_model_len, LOCAL_FLEET.kv_cache_memory)
    engine = parse_fleet("chat", "ns", default_fleet()["spec"]).engine
    assert (engine.max_num_seqs, engine.max_model_len, engine.kv_cache_memory) == (
        LOCAL_CLUSTER.max_num_seqs, LOCAL_CLUSTER.max_model_len, LOCAL_CLUSTER.kv_cache_memory)


_sizes = st.one_of(st.none(), st.integers(1, 1 << 40),
                   st.builds(lambda n, unit: f"{n}{unit}", st.integers(1, 4096), st.sampled_from(["MiB", "Gi", "GB"])))
valid_settings = st.fixed_dictionaries({
    "model": st.sampled_from([DEFAULT_MODEL, "/models/llama", "tiny"]),
    "max_model_len": st.one_of(st.none(), st.integers(1, 1 << 20)),
    "max_num_seqs": st.integers(1, 4096),
    "max_num_batched_tokens": st.integers(1, 1 << 16),
    "max_num_waiting": st.integers(0, 1 << 16),
    "block_size": st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]),
    "kv_cache_memory": _sizes,
    "gpu_memory_utilization": st.floats(0.0, 1.0, exclude_min=True),
    "enable_prefix_caching": st.booleans(),
    "dtype": st.sampled_from(DTYPES),
    "device": st.sampled_from(["auto", "cpu", "cuda", "cuda:1"]),
    "seed": st.integers(0, 2**31),
    "attention_backend": st.sampled_from(["auto", "torch", "triton"]),
})


@given(valid_settings)
def test_to_args_reads_back_as_the_same_settings(values: dict) -> None:
    config = EngineConfig(**values)
    assert engine_config_from_args(engine_parser().parse_args(config.to_args())) == config
    # Unread sizes (as `kvfleet up` and the benchmarks pass them) give the same engine too.
    assert engine_config_from_args(engine_parser().parse_args(EngineSettings(**values).to_args())) == config


@given(st.builds(FleetEngineSettings, max_model_len=st.integers(16, 1 << 20), max_num_seqs=st.integers(1, 4096),
                 block_size=st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]),
                 kv_cache_memory=st.sampled_from([None, "1Gi", "512MiB"]),
                 gpu_memory_utilization=st.one_of(st.none(), st.floats(0.05, 1.0))))
def test_a_fleets_engine_flags_read_back_as_its_settings(engine: FleetEngineSettings) -> None:
    config = engine_config_from_args(engine_parser().parse_args(engine.to_args()))
    for f, _ in crd_fields():
        expected = getattr(engine, f.name)
        if expected is not None:
            assert getattr(config, f.name) == getattr(EngineConfig(**{f.name: expected}), f.name), f.name


@pytest.mark.parametrize("name", [s for s, schema in SPEC_SCHEMA["properties"]["engine"]["properties"].items()
                                  if "enum" in schema])
def test_the_parser_accepts_exactly_the_crds_enumerated_values(name: str) -> None:
    """blockSize: the CRD used to allow 1..1024 while the engine takes powers of two up to 128, so a fleet with
    blockSize 3 passed validation and its pods crash-looped; now the API server and the parser refuse it."""
    allowed = SPEC_SCHEMA["properties"]["engine"]["properties"][name]["enum"]
    setting = next(f.name for f, crd in crd_fields() if crd.name == name)
    for value in allowed:
        assert getattr(parse_fleet("f", "ns", {**MINIMAL, "engine": {name: value}}).engine, setting) == value
        EngineConfig(**{setting: value})  # and the engine takes every value the CRD allows
    for value in (0, 3, max(allowed) * 2, True):
        with pytest.raises(InvalidSpec, match=name):
            parse_fleet("f", "ns", {**MINIMAL, "engine": {name: value}})


def test_the_gateway_flags_defaults_are_gatewayconfigs() -> None:
    """`kvfleet gateway` with no flags makes the same GatewayConfig as the dataclass's own defaults."""
    from kvfleet.gateway.cli_args import add_gateway_args, gateway_config_from_args
    from kvfleet.gateway.config import GatewayConfig
    parser = argparse.ArgumentParser()
    with mock.patch.dict(os.environ):
        os.environ.pop(ENGINE_API_KEY_ENV, None)
        add_gateway_args(parser)
    from_flags, declared_defaults = gateway_config_from_args(parser.parse_args([])), GatewayConfig()
    differ = [f.name for f in dataclasses.fields(GatewayConfig) if f.name != "gateway_id"
              and getattr(from_flags, f.name) != getattr(declared_defaults, f.name)]
    assert differ == []


def test_the_charts_gateway_values_are_the_gateways_defaults_and_choices() -> None:
    """values.yaml restates a few `kvfleet gateway` defaults (helm users read them there); they must be the same."""
    import json

    import yaml

    from kvfleet.gateway.config import GatewayConfig
    from kvfleet.gateway.routing.strategies import STRATEGIES
    chart = CHART
    values = yaml.safe_load((chart / "values.yaml").read_text())["gateway"]
    schema = json.loads((chart / "values.schema.json").read_text())["properties"]["gateway"]["properties"]
    defaults = GatewayConfig()
    assert values["maxQueueMs"] == defaults.default_max_queue_ms
    assert schema["maxQueueMs"]["maximum"] == defaults.max_queue_ms_limit
    assert values["routing"] == defaults.routing
    assert schema["routing"]["enum"] == list(STRATEGIES)
    assert values["port"] == build_parser().parse_args(["gateway"]).port


@pytest.mark.parametrize("name", ["enabled", "criticalLane"])
@pytest.mark.parametrize("value", ["false", "yes", 1, 0, None, [True]])
def test_a_switch_is_true_or_false_and_nothing_else(name: str, value: object) -> None:
    """bool() of the string "false" is True: a switch written as a string or a number is refused, not guessed."""
    with pytest.raises(InvalidSpec, match=f"spec.autoscaling.{name} must be true or false"):
        parse_fleet("f", "ns", {**MINIMAL, "autoscaling": {name: value}})
    fleet = parse_fleet("f", "ns", {**MINIMAL, "autoscaling": {name: True}})
    assert (fleet.autoscaling_enabled if name == "enabled" else fleet.autoscaling.critical_lane) is True
