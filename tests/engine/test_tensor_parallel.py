"""Tensor parallelism: ranks as separate local processes (gloo), compared with one rank.

A sum reduced over ranks adds the same products in another order than one rank's product, so
float32 results differ in the last bits: tokens follow ``tests/same_output.py``'s batched rule,
and logprobs agree within 1e-4 up to the first divergence (what float32 rounding of a
64-wide sum of O(1) terms allows, with room; a wrong shard is off by far more).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from engine.config import EngineConfig, SpeculativeConfig
from engine.core import EngineCore
from engine.loader import ModelSpec, load_model
from engine.params import GenerationRequest, RankLostError, Role, SamplingParams
from engine.tensor_parallel import check_degree
from engine.tp_worker import local_launcher
from tests import same_output
from tests.engine.conftest import assert_pool_idle, greedy, run_to_completion
from tests.tiny_models import tiny_tp_config
from tests.waiting import wait_until

LOGPROB_TOLERANCE = 1e-4
PROMPT_LENGTHS = (5, 40, 77, 130)


def _spec(tmp_path: Path, family: str, kv_heads: int = 4) -> ModelSpec:
    folder = tmp_path / f"{family}-{kv_heads}"
    tiny_tp_config(family, kv_heads).save_pretrained(folder)
    return ModelSpec(source=str(folder), dummy_weights=True)


def _engine(spec: ModelSpec, degree: int, **settings: object) -> EngineCore:
    settings = {"max_model_len": 256, "kv_cache_bytes": 4 << 20, "block_size": 8, **settings}
    return EngineCore.from_spec(spec, EngineConfig(tensor_parallel_size=degree, **settings))


def _batch(shared_prefix: int = 16) -> dict[int, list[GenerationRequest]]:
    """Prompts of different lengths arriving over three steps; two share a prefix, and a prompt
    that repeats itself gets speculation's proposals accepted (where it is on)."""
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]
    prompts[3][:shared_prefix] = prompts[2][:shared_prefix]
    prompts.append([11, 12, 13, 14, 15] * 6 + [1])
    requests = [GenerationRequest(f"r{i}", tuple(p), greedy()) for i, p in enumerate(prompts)]
    return {0: requests[:2], 1: requests[2:3], 3: requests[3:]}


def _run(core: EngineCore, arrivals: dict[int, list[GenerationRequest]], close: bool = True) -> tuple[dict, dict]:
    try:
        outputs = run_to_completion(core, arrivals)
        assert_pool_idle(core)
    finally:
        if close:
            core.close()
    return {rid: same_output.trace_from_outputs(outs) for rid, outs in outputs.items()}, outputs


def _assert_same(reference: dict, actual: dict, label: str) -> None:
    (ref_traces, ref_outputs), (traces, outputs) = reference, actual
    assert sorted(traces) == sorted(ref_traces)
    for rid in ref_traces:
        same_output.assert_same_output(ref_traces[rid], traces[rid], exact=False, label=f"{label} {rid}")
        upto = same_output.first_divergence(ref_traces[rid], traces[rid]) or len(ref_traces[rid].tokens)
        ref_lp = [lp.logprob for o in ref_outputs[rid] for lp in o.logprobs][:upto]
        lp = [lp.logprob for o in outputs[rid] for lp in o.logprobs][:upto]
        assert max(abs(a - b) for a, b in zip(ref_lp, lp)) < LOGPROB_TOLERANCE, f"{label} {rid}"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tp_2_and_4_give_tp_1_s_tokens_with_chunked_prefill_prefix_caching_and_speculation(tmp_path, family):
    """Llama's engines speculate: the verify rows and the blocks given back after rejected
    proposals reach the other ranks in the plan (proposals both accepted and rejected)."""
    spec = _spec(tmp_path, family)
    settings = {"enable_chunked_prefill": True, "max_num_batched_tokens": 48}
    if family == "llama":
        settings["speculative"] = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    reference = _run(_engine(spec, 1, **settings), _batch())
    for degree in (2, 4):
        core = _engine(spec, degree, **settings)
        assert core.layout.num_kv_heads == 4 // degree  # this rank's KV heads only
        assert core.limits.num_blocks == degree * (4 << 20) // (core.layout.bytes_per_block * degree)
        result = _run(core, _batch())
        assert core.scheduler.prefix_hit_tokens == 16  # the shared prefix's two blocks
        if family == "llama":
            assert 0 < core.spec_counters.num_accepted_tokens < core.spec_counters.num_draft_tokens
        _assert_same(reference, result, f"{family} TP {degree}")


def test_replicated_kv_heads_in_a_lent_prefill_engine_then_a_lost_rank(tmp_path):
    """TP 4 over 2 KV heads (each on two ranks), started as a prefill replica and lent (role
    ``both``, as the autoscaler's lend sets it), decodes with its four ranks and gives TP 1's
    tokens; then a rank is killed: the next step fails with ``RankLostError``, the health check
    names the rank, every block is free."""
    spec = _spec(tmp_path, "llama", kv_heads=2)
    reference = _run(_engine(spec, 1), _batch())
    core = _engine(spec, 4, role=Role.PREFILL)
    try:
        core.set_role(Role.BOTH)
        assert core.layout.num_kv_heads == 1
        _assert_same(reference, _run(core, _batch(), close=False), "llama 2 KV heads TP 4")
        assert [r["kv_heads"] for r in core.ranks()] == [[0, 1], [0, 1], [1, 1], [1, 1]]
        pid = core.tp.pids[1]
        assert core.health_problem() is None
        os.kill(pid, signal.SIGKILL)  # rank 2, a process this test started
        wait_until(core.health_problem, 60, "the lost rank noticed")
        core.add_request(GenerationRequest("lost", tuple(range(1, 20)), SamplingParams(max_tokens=4)))
        with pytest.raises(RankLostError, match="tensor-parallel rank 2 exited"):
            while core.has_work():
                core.step()
        assert "tensor-parallel rank 2 exited (code -9)" in core.health_problem()
        core.abort_all()
        assert_pool_idle(core)
    finally:
        core.close()


def test_the_default_architecture_at_tp_3_gives_tp_1_s_tokens(tiny_served, smol_prompts):
    """The tiny model of the default model's architecture (tests/tiny_models.py: its 3 KV heads,
    one per rank as the default model's, and its tied embeddings), loaded by each rank from its
    model directory; the default model's own degrees are checked below."""
    spec = ModelSpec(source=tiny_served.args["model.source"])
    arrivals = {0: [GenerationRequest(f"p{i}", tuple(p), greedy()) for i, p in enumerate(smol_prompts[:4])]}
    reference = _run(_engine(spec, 1, max_model_len=512, kv_cache_bytes=32 << 20), arrivals)
    core = _engine(spec, 3, max_model_len=512, kv_cache_bytes=32 << 20)
    assert core.layout.num_kv_heads == 1
    _assert_same(reference, _run(core, arrivals), "default architecture TP 3")


@pytest.mark.parametrize(
    ("degree", "named"),
    [
        (3, r"num_attention_heads=8, intermediate_size=128, num_key_value_heads=4 \(must be"),
        (16, "num_attention_heads=8$"),  # 16 ranks would replicate each KV head 4 times, but 8 heads
    ],
)
def test_a_degree_the_model_cannot_split_is_refused_naming_the_sizes(degree, named):
    with pytest.raises(ValueError, match=f"decode.tensor_parallel_size={degree} does not divide the model's {named}"):
        check_degree(tiny_tp_config("llama"), degree, "decode.tensor_parallel_size")
    check_degree(tiny_tp_config("llama"), 8, "decode.tensor_parallel_size")  # 8 ranks: each KV head on two


def test_the_default_model_takes_degree_1_or_3(smol):
    for degree in (1, 3, 9):
        if degree == 9:
            with pytest.raises(ValueError, match="intermediate_size=1536"):
                check_degree(smol.model.config, degree)
        else:
            check_degree(smol.model.config, degree)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the model's num_attention_heads=9"):
        check_degree(smol.model.config, 2)


def test_a_rank_that_dies_before_joining_fails_the_start_at_once(tmp_path):
    """A worker that exits before it reaches rank 0's store (here: an invalid thread count) ends
    the start with the rank and its exit code, not after the collectives' 600 s timeout."""
    spec = _spec(tmp_path, "llama")
    config = EngineConfig(tensor_parallel_size=2, max_model_len=256, kv_cache_bytes=4 << 20, block_size=8)
    with pytest.raises(
        RuntimeError, match=r"tensor-parallel ranks did not start: tensor-parallel rank 1 exited \(code 1\)"
    ):
        EngineCore(load_model(spec), config, local_launcher(spec, threads=0))
