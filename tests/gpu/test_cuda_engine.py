"""EngineCore on CUDA against transformers' greedy ``generate`` on the same model and device
(the rule: tests/same_output.py): token for token in float32 one request at a time, by the
first-divergence rule in bfloat16 and in a continuous batch; prefill role then decode role
gives the tokens of the ``both`` role."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loader import LoadedModel
from engine.params import GenerationRequest, PrefillResult, RequestOutput, Role, SamplingParams
from tests import same_output
from tests.same_output import MIN_COMPARED_TOKENS, GreedyTrace, assert_same_output
from tests.same_output import trace_from_outputs as trace_of
from tests.tiny_models import FAMILIES, tiny_config

PROMPT_LENGTHS = (1, 5, 40, 130, 300)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def tiny_pair(family: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> tuple[LoadedModel, LoadedModel]:
    """A random-weight model of a real family made on ``device`` (as tests/engine's
    ``tiny_loaded``), and an untouched copy for ``generate``."""
    config = tiny_config(family)
    torch.manual_seed(seed)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # compare a fixed number of tokens
    reference = copy.deepcopy(model)
    name = f"tiny-{family}-{dtype}"
    return LoadedModel(model, None, name), LoadedModel(reference, None, name)


def prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]


def hf_greedy(reference: LoadedModel, prompt: list[int]) -> GreedyTrace:
    return same_output.hf_greedy(reference.model, prompt, MIN_COMPARED_TOKENS)


def requests(prefix: str) -> list[GenerationRequest]:
    sampling = SamplingParams(max_tokens=MIN_COMPARED_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    return [GenerationRequest(f"{prefix}-{i}", tuple(p), sampling) for i, p in enumerate(prompts())]


def run_to_completion(core: EngineCore, batch: list[GenerationRequest]) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in batch}
    for request in batch:
        core.add_request(request)
    while core.has_work():
        for out in core.step():
            outputs[out.request_id].append(out)
    return outputs


@pytest.fixture
def make_engine() -> Iterator:
    """Engines on the model's device; after the test each must have every block free again."""
    made: list[EngineCore] = []

    def build(loaded: LoadedModel, **config: object) -> EngineCore:
        core = EngineCore(loaded, EngineConfig(max_model_len=512, block_size=8, kv_cache_bytes=16 << 20, **config))
        assert core.pool.tensor.device == loaded.model.device
        made.append(core)
        return core

    yield build
    for core in made:
        stats = core.stats()
        assert stats.num_free_blocks == stats.num_total_blocks, stats
        busy = (stats.num_pinned_blocks, stats.num_reserved_blocks, stats.num_running, stats.num_waiting)
        assert busy == (0, 0, 0, 0), stats


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_at_a_time_matches_generate(cuda, make_engine, family, dtype):
    loaded, reference = tiny_pair(family, DTYPES[dtype], cuda)
    core = make_engine(loaded)
    exact = dtype == "float32"
    for request, prompt in zip(requests(f"{family}-solo"), prompts()):
        got = trace_of(run_to_completion(core, [request])[request.request_id])
        assert_same_output(hf_greedy(reference, prompt), got, exact=exact, label=f"{family} {dtype} solo")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_continuous_batch_matches_generate(cuda, make_engine, family, dtype):
    loaded, reference = tiny_pair(family, DTYPES[dtype], cuda)
    core = make_engine(loaded, max_num_seqs=len(PROMPT_LENGTHS))
    batch = requests(f"{family}-batch")
    outputs = run_to_completion(core, batch)
    for request, prompt in zip(batch, prompts()):
        label = f"{family} {dtype} {request.request_id}"
        assert_same_output(hf_greedy(reference, prompt), trace_of(outputs[request.request_id]), False, label)
        assert outputs[request.request_id][-1].finish_reason.value == "length"


def _prefill_then_decode(prefill_core: EngineCore, decode_core: EngineCore, request: GenerationRequest):
    prefill_core.add_prefill(request)
    finals = []
    while prefill_core.has_work():
        finals += prefill_core.step()
    (final,) = finals
    result = PrefillResult.from_output(final)
    assert result.finish_reason is None and len(result.block_ids) == -(-len(request.prompt_token_ids) // 8)
    blocks = decode_core.reserve(request.request_id, result.num_tokens)
    decode_core.pool.copy_blocks_from(prefill_core.pool, list(result.block_ids), blocks)
    assert prefill_core.release(request.request_id)
    decode_core.add_decode(request, blocks, result.first_token, result.first_logprobs)
    outputs = []
    while decode_core.has_work():
        outputs += decode_core.step()
    return outputs


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_prefill_role_then_decode_role_equals_both(cuda, make_engine, dtype):
    loaded, _ = tiny_pair("llama", DTYPES[dtype], cuda)
    both = make_engine(loaded)
    prefill_core, decode_core = make_engine(loaded, role=Role.PREFILL), make_engine(loaded, role=Role.DECODE)
    for i in (0, 2, 4):  # 1, 40 and 300 prompt tokens
        request = requests(f"pd-{dtype}")[i]
        expected = trace_of(run_to_completion(both, [request])[request.request_id])
        got = trace_of(_prefill_then_decode(prefill_core, decode_core, request))
        # the same kernels on the same shapes: float32 must agree token for token
        assert_same_output(expected, got, exact=dtype == "float32", label=f"roles {dtype} prompt {i}")


def test_seeded_sampling_repeats_with_generators_on_the_device(cuda, make_engine):
    loaded, _ = tiny_pair("llama", torch.bfloat16, cuda)
    core = make_engine(loaded)
    prompt = tuple(prompts()[2])

    def sample(request_id: str, seed: int | None) -> list[int]:
        sp = SamplingParams(max_tokens=24, temperature=0.9, top_k=50, top_p=0.9, seed=seed, min_tokens=4, logprobs=2)
        out = run_to_completion(core, [GenerationRequest(request_id, prompt, sp)])[request_id]
        assert all(len(o.logprobs) == len(o.token_ids) for o in out)
        return [t for o in out for t in o.token_ids]

    first, again, other = sample("s1", 123), sample("s2", 123), sample("s3", None)
    assert first == again and len(first) == 24 and len(other) == 24
    assert all(0 <= t < 512 for t in first + other)
