"""Decode steps replayed from CUDA graphs give the eager engine's tokens (the same model on
the same GPU), by tests/same_output.py's rule: a padded batch and an always-present mask may
change the last bits of a logit, never more than a near-tie. CPU tests of the padding and of
the replay path with a fake graph: tests/engine/test_cuda_graphs.py."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.fused_linear import FusedLinear
from tests.gpu.test_cuda_engine import DTYPES, requests, run_to_completion, tiny_pair
from tests.same_output import assert_same_output
from tests.same_output import trace_from_outputs as trace_of

pytestmark = pytest.mark.cuda

CONFIG = dict(max_model_len=512, block_size=8, kv_cache_bytes=16 << 20, max_num_seqs=8)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-kernels", "model-forward"])
@pytest.mark.parametrize(
    ("family", "dtype"), [("llama", "float32"), ("llama", "bfloat16"), ("qwen2", "bfloat16"), ("qwen3", "bfloat16")]
)
def test_graph_replayed_decode_gives_the_eager_tokens(cuda, family, dtype, fused):
    loaded, _ = tiny_pair(family, DTYPES[dtype], cuda)
    twin = copy.deepcopy(loaded)
    eager = EngineCore(twin, EngineConfig(**CONFIG))
    eager.runner.use_cuda_graphs(None)
    graphed = EngineCore(loaded, EngineConfig(**CONFIG))
    kernels = graphed.runner.triton_decode_kernels() if fused else None
    assert (kernels is not None) == fused
    graphed.runner.use_cuda_graphs((1, 2, 4, 8), kernels=kernels)
    batch = requests(f"{family}-eager")
    expected = run_to_completion(eager, batch)
    got = run_to_completion(graphed, requests(f"{family}-eager"))
    for request in batch:
        rid = request.request_id
        label = f"{family} {dtype} {rid}"
        assert_same_output(trace_of(expected[rid]), trace_of(got[rid]), exact=False, label=label)
    graphs = graphed.runner.graphs
    # five prompts (1 to 300 tokens) decode together, padded to 8, then fewer as they end
    assert max(k.batch for k in graphs.captured) == 8
    assert {k.batch for k in graphs.captured} <= {1, 2, 4, 8}
    assert max(k.num_blocks for k in graphs.captured) == 64  # 300 + 32 tokens: 42 blocks of 8
    assert graphs.num_replays > 0
    torch.cuda.synchronize()


def test_graphs_and_fused_kernels_are_on_by_default_on_cuda_and_padding_rows_touch_no_other_block(cuda):
    loaded, _ = tiny_pair("llama", torch.bfloat16, cuda)
    core = EngineCore(loaded, EngineConfig(**CONFIG))
    assert core.runner.graphs is not None
    # engine.weights.optimize_cuda_layout: the engine's comparisons with transformers (test_cuda_engine.py) run on it
    layer = core.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, FusedLinear) and isinstance(layer.mlp.gate_proj, FusedLinear)
    assert layer.input_layernorm.forward.__func__.__name__ == "_rms_norm_forward"
    assert core.runner.fused_decode is not None  # engine.fused_decode on the Triton kernels
    before = core.pool.tensor.clone()
    batch = requests("pad")[:3]  # three sequences: padded to 4 by repeating the first
    outputs = run_to_completion(core, batch)
    assert all(out[-1].finish_reason.value == "length" for out in outputs.values())
    assert core.runner.graphs.num_replays > 0
    # only the blocks the three requests used changed (their blocks are free again, contents stay)
    changed = (core.pool.tensor != before).flatten(3).any(-1).any(0).any(0).nonzero().flatten().tolist()
    used = -(-(1 + 32) // 8) + -(-(5 + 32) // 8) + -(-(40 + 32) // 8)
    assert len(changed) <= used


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_steps_in_flight_give_the_synchronous_tokens_and_an_abort_waits_for_its_step(cuda, dtype):
    """``engine.overlap`` on the GPU (pinned token copies, events, tokens fed into the next
    graph on the device): the synchronous engine's tokens; a request aborted while a step
    holding it is in flight leaves the KV accounting whole, and every block is free at the end.
    CPU tests of the bookkeeping: tests/engine/test_overlap.py."""
    loaded, _ = tiny_pair("llama", DTYPES[dtype], cuda)
    sync = EngineCore(copy.deepcopy(loaded), EngineConfig(**CONFIG, async_scheduling="off"))
    core = EngineCore(loaded, EngineConfig(**CONFIG))
    assert core.config.async_scheduling == "auto" and core.runner.graphs is not None
    expected = run_to_completion(sync, requests("overlap"))
    got = run_to_completion(core, requests("overlap"))
    for rid, outputs in expected.items():
        assert_same_output(trace_of(outputs), trace_of(got[rid]), exact=False, label=f"llama {dtype} {rid}")
    first, second = requests("abort")[:2]
    core.add_request(first)
    core.add_request(second)
    left_in_flight = [bool(core.step()) for _ in range(2)]  # the prompts, then a decode step in flight
    assert left_in_flight == [True, False]
    assert core.abort(first.request_id)
    assert core.kv_report().problems == ()
    tokens = [t for _ in range(4) for out in core.step() for t in out.token_ids if out.request_id == first.request_id]
    assert tokens == []  # nothing after the abort, not even the token in flight
    assert core.abort(second.request_id)
    while core.has_work():
        core.step()
    report = core.kv_report()
    assert report.problems == () and report.num_in_use_blocks == 0
    torch.cuda.synchronize()
