"""AppConfig: sources and their precedence, cross-field checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.config import AppConfig


def test_defaults_are_one_prefill_and_one_decode_on_cpu():
    config = AppConfig.load({}, environ={})
    assert (config.prefill.num_replicas, config.decode.num_replicas) == (1, 1)
    assert config.model.source == "default" and config.transport.kind == "nixl" and config.transport.mode == "pull"
    assert config.prefill.ray_actor_options() == {"num_cpus": 0.5}


def test_yaml_then_environment_then_builder_args(tmp_path):
    path = tmp_path / "app.yaml"
    path.write_text("transport:\n  mode: push\n  kv_transfer_timeout_s: 5\ndecode:\n  num_replicas: 3\n")
    env = {"TANDEM__DECODE__NUM_REPLICAS": "2", "TANDEM__PREFILL__RESOURCES": "{prefill_node: 1}"}
    config = AppConfig.load({"config": str(path), "transport.kv_transfer_timeout_s": "7"}, environ=env)
    assert config.transport.mode == "push" and config.transport.kv_transfer_timeout_s == 7
    assert config.decode.num_replicas == 2
    assert config.prefill.ray_actor_options() == {"num_cpus": 0.5, "resources": {"prefill_node": 1}}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"transport.kind": "object_store", "transport.mode": "push"}, "push needs transport.kind=nixl"),
        ({"engine.max_num_batched_tokens": "256"}, "needs engine.enable_chunked_prefill"),
        ({"transport.mode": "pipe"}, "transport.mode"),
        ({"decode.num_cpus": "0"}, "num_cpus"),
        ({"model.unknown": "1"}, "unknown"),
        (
            {"decode.tensor_parallel_size": "3", "transport.kind": "object_store"},
            "decode.tensor_parallel_size > 1 needs transport.kind=nixl and transport.staging=none",
        ),
        ({"prefill.tensor_parallel_size": "3", "transport.staging": "host"}, r"got nixl, host"),
    ],
)
def test_invalid_settings_are_refused_with_the_field(args, message):
    with pytest.raises(ValidationError, match=message):
        AppConfig.load(args, environ={})


def test_every_field_is_described():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            annotation = field.annotation
            if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
                walk(annotation)

    walk(AppConfig)
