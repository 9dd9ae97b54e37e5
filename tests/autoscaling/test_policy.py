"""Policies: the shipped YAMLs load; contradictory or unknown values are refused naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from app.settings import AppConfig
from autoscaling.config import AutoscalingSettings
from autoscaling.policy import POLICY_DIR, Policy, PolicyError, load_policy

SHIPPED = sorted(POLICY_DIR.glob("*.yaml"))


def _default_data() -> dict[str, Any]:
    return yaml.safe_load((POLICY_DIR / "default.yaml").read_text())


def _write(tmp_path: Path, data: Any, name: str = "mine.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_three_policies_are_shipped():
    assert {p.stem for p in SHIPPED} >= {"default", "latency_first", "cost_first"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_policy_loads_by_name_and_by_path(path: Path):
    policy = load_policy(path.stem)
    assert isinstance(policy, Policy) and policy.name == path.stem
    assert load_policy(str(path)) == policy
    assert policy.max_lent >= 1 and policy.replicas.decode.min >= 1


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_policy_is_commented(path: Path):
    assert any(line.lstrip().startswith("#") for line in path.read_text().splitlines())


def test_the_default_policy_values():
    policy = load_policy("default")
    assert (policy.slo.ttft_p90_ms, policy.slo.tpot_p90_ms) == (3000, 120)
    assert (policy.max_lent, policy.cooldown_s, policy.replicas.prefill.min) == (1, 5, 0)
    assert (policy.decode_pressure.kv_usage.enter, policy.decode_pressure.kv_usage.leave) == (0.75, 0.4)
    assert not policy.decode_pressure.tpot_slo_ratio.on


@pytest.mark.parametrize(
    ("change", "fields"),
    [
        (
            lambda d: d["decode_pressure"].update(kv_usage={"enter": 0.3, "leave": 0.4}),
            ["decode_pressure.kv_usage", "enter"],
        ),
        (lambda d: d["decode_pressure"].update(waiting={"enter": 2, "leave": 2}), ["decode_pressure.waiting", "enter"]),
        (lambda d: d["decode_pressure"].update(waiting={"enter": 2}), ["decode_pressure.waiting", "together"]),
        (
            lambda d: d["decode_pressure"].update(kv_usage={"enter": 1.5, "leave": 0.4}),
            ["decode_pressure.kv_usage.enter"],
        ),
        (lambda d: d["replicas"].update(prefill={"min": 3, "max": 2}), ["replicas.prefill", "min (3)", "max (2)"]),
        (lambda d: d.update(window_s=0.5), ["window_s (0.5)", "interval_s (1.0)"]),
        (lambda d: d.update(stale_after_s=0.5), ["stale_after_s (0.5)", "interval_s"]),
        (lambda d: d.update(max_lend=2), ["max_lend", "Extra inputs are not permitted"]),
        (lambda d: d["decode_pressure"].update(queue_depth={"enter": 1, "leave": 0}), ["decode_pressure.queue_depth"]),
        (lambda d: d.update(decode_pressure={}), ["no signal is on", "max_lent"]),
        (lambda d: d.update(cooldown_s=-1), ["cooldown_s"]),
        (lambda d: d.pop("slo"), ["slo"]),
    ],
    ids=[
        "enter-below-leave",
        "enter-equal-leave",
        "enter-without-leave",
        "kv-share-above-1",
        "min-above-max",
        "window-below-interval",
        "stale-below-interval",
        "unknown-field",
        "unknown-signal",
        "no-decode-signal",
        "negative-cooldown",
        "missing-slo",
    ],
)
def test_contradictory_or_unknown_values_are_refused_naming_the_field(tmp_path, change, fields):
    data = _default_data()
    change(data)
    path = _write(tmp_path, data)
    with pytest.raises(PolicyError) as caught:
        load_policy(str(path))
    message = str(caught.value)
    assert message.startswith(f"{path}: ")
    for field in fields:
        assert field in message


def test_a_policy_that_is_not_a_mapping_is_refused(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(PolicyError, match="expected a mapping at the top level"):
        load_policy(str(path))


def test_a_policy_that_is_not_yaml_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("slo: {ttft_p90_ms: 3000\nmax_lent: [\n")
    with pytest.raises(PolicyError, match="broken.yaml"):
        load_policy(str(path))


@pytest.mark.parametrize("name", ["no_such_policy", "/nowhere/mine.yaml", "default.yml"])
def test_a_missing_policy_lists_the_shipped_names(name):
    with pytest.raises(PolicyError) as caught:
        load_policy(name)
    message = str(caught.value)
    assert f"no policy {name!r}" in message
    assert "shipped: cost_first, default, gpu, latency_first" in message


def test_a_file_name_defaults_the_policy_name(tmp_path):
    data = _default_data()
    assert load_policy(str(_write(tmp_path, data, "night.yaml"))).name == "night"
    data["name"] = "batch nights"
    assert load_policy(str(_write(tmp_path, data, "night.yaml"))).name == "batch nights"


def test_the_app_loads_a_shipped_policy_by_name():
    config = AppConfig.load({"autoscaling.policy": "latency_first"}, environ={})
    assert config.autoscaling.enabled and config.autoscaling.policy == "latency_first"
    policy = config.autoscaling.load(config.slo.ttft_ms, config.slo.tpot_ms)
    assert policy == load_policy("latency_first")


def test_the_app_refuses_a_bad_policy_naming_the_field(tmp_path):
    data = _default_data()
    data["decode_pressure"]["kv_usage"] = {"enter": 0.3, "leave": 0.4}
    path = _write(tmp_path, data)
    with pytest.raises(ValidationError) as caught:
        AppConfig.load({"autoscaling.policy": str(path)}, environ={})
    message = str(caught.value)
    assert "decode_pressure.kv_usage" in message and "enter (0.3) must be above leave (0.4)" in message
    with pytest.raises(ValidationError, match="no policy 'nope'"):
        AppConfig.load({"autoscaling.policy": "nope"}, environ={})


def test_the_app_skips_the_policy_when_autoscaling_is_off():
    config = AppConfig.load({"autoscaling.enabled": "false", "autoscaling.policy": "/nowhere/mine.yaml"}, environ={})
    assert config.autoscaling.enabled is False and config.autoscaling.policy == "/nowhere/mine.yaml"


def test_the_app_slo_replaces_the_policy_targets():
    config = AppConfig.load({"slo.ttft_ms": "800", "autoscaling.policy": "cost_first"}, environ={})
    policy = config.autoscaling.load(config.slo.ttft_ms, config.slo.tpot_ms)
    assert (policy.slo.ttft_p90_ms, policy.slo.tpot_p90_ms) == (800, 200)
    assert policy.name == "cost_first" and policy.max_lent == 4


def test_with_slo_replaces_only_the_targets_given():
    policy = load_policy("default")
    assert policy.with_slo(None, None) == policy
    both = policy.with_slo(500, 40)
    assert (both.slo.ttft_p90_ms, both.slo.tpot_p90_ms) == (500, 40)
    assert both.model_copy(update={"slo": policy.slo}) == policy  # nothing else changed
    assert policy.with_slo(None, 40).slo.ttft_p90_ms == 3000
    assert (policy.slo.ttft_p90_ms, policy.slo.tpot_p90_ms) == (3000, 120)  # the original is untouched


def test_settings_refuse_unknown_fields():
    with pytest.raises(ValidationError, match="polcy"):
        AutoscalingSettings.model_validate({"polcy": "default"})
