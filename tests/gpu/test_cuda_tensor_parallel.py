"""Tensor parallelism on CUDA (NCCL all-reduces, one GPU per rank): TP 2 gives TP 1's tokens by
tests/same_output.py's batched rule. NCCL refuses two ranks on one GPU, so this needs two."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loader import ModelSpec
from engine.params import GenerationRequest, SamplingParams
from tests.same_output import assert_same_output, trace_from_outputs
from tests.tiny_models import tiny_tp_config

pytestmark = pytest.mark.cuda


@pytest.fixture
def spec(tmp_path) -> ModelSpec:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    tiny_tp_config("llama").save_pretrained(tmp_path)
    return ModelSpec(source=str(tmp_path), dummy_weights=True, device="cuda", dtype="float32")


def _traces(spec: ModelSpec, degree: int) -> dict:
    settings = {"max_model_len": 256, "kv_cache_bytes": 4 << 20, "block_size": 8}
    core = EngineCore.from_spec(spec, EngineConfig(tensor_parallel_size=degree, **settings))
    sampling = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=5)
    try:
        for i, n in enumerate((5, 40, 130)):
            core.add_request(GenerationRequest(f"r{i}", tuple((7 * i + j) % 500 + 1 for j in range(n)), sampling))
        outputs: dict = {}
        while core.has_work():
            for out in core.step():
                outputs.setdefault(out.request_id, []).append(out)
    finally:
        core.close()
    return {rid: trace_from_outputs(outs) for rid, outs in outputs.items()}


def test_tp_2_over_nccl_gives_tp_1_s_tokens(spec):
    one, two = _traces(spec, 1), _traces(spec, 2)
    for rid in one:
        assert_same_output(one[rid], two[rid], exact=False, label=rid)
