"""KV between tensor-parallel engines of different degrees, pull, over real NIXL.

Three engines of a tiny random Llama (8 query heads, 4 KV heads) with 1, 2 and 4 ranks, each
rank its own process (Ray actors on the session's cluster) with its own NIXL agent. Each engine
has role ``both``, so each one prefills for, and decodes from, every other.
"""

from __future__ import annotations

import pytest
import ray

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loader import ModelSpec
from engine.params import GenerationRequest
from tests import same_output
from tests.engine.conftest import greedy, run_to_completion
from tests.tiny_models import tiny_tp_config

DEGREES = (1, 2, 4)
BLOCK_SIZE = 8
LAYERS, KV_HEADS, HEAD_DIM = 3, 4, 8
PROMPT_LENGTHS = (9, 33, 70)
SETTINGS = {"max_model_len": 256, "kv_cache_bytes": 2 << 20, "block_size": BLOCK_SIZE}


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> ModelSpec:
    folder = tmp_path_factory.mktemp("tiny-tp")
    tiny_tp_config("llama").save_pretrained(folder)
    return ModelSpec(source=str(folder), dummy_weights=True)


@pytest.fixture(scope="module")
def engines(shared_serve, spec):
    from bench.engine_actor import EngineActor

    shared_serve.ray()
    actors = {
        d: EngineActor.options(num_cpus=0.01).remote(f"tp{d}", "both", spec=spec, tensor_parallel_size=d, **SETTINGS)
        for d in DEGREES
    }
    ray.get([a.start.remote() for a in actors.values()])
    yield actors
    ray.get([a.close.remote() for a in actors.values()])
    for actor in actors.values():
        ray.kill(actor)


def _requests(tag: str, seed: int = 0) -> list[GenerationRequest]:
    """Prompts of their own per ``seed``: no engine's prefix cache holds them yet."""
    prompts = [[(5 * i + 11 * j + 97 * seed) % 500 + 1 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]
    return [GenerationRequest(f"{tag}-{i}", tuple(p), greedy()) for i, p in enumerate(prompts)]


PAIRS = [(2, 4), (4, 2), (1, 2), (2, 1)]


@pytest.fixture(scope="module")
def reference(spec) -> dict[str, same_output.GreedyTrace]:
    """One rank, one process: the tokens every pair must give (every pair's prompts)."""
    core = EngineCore.from_spec(spec, EngineConfig(**SETTINGS))
    requests = [r for seed in range(len(PAIRS)) for r in _requests(f"ref{seed}", seed)]
    outputs = run_to_completion(core, {0: requests})
    return {rid: same_output.trace_from_outputs(outs) for rid, outs in outputs.items()}


@pytest.mark.parametrize(("producer", "consumer"), PAIRS)
def test_a_pull_between_degrees_gives_one_rank_s_tokens_and_each_rank_reads_its_heads(
    engines, reference, producer, consumer
):
    prefill, decode = engines[producer], engines[consumer]
    seed = PAIRS.index((producer, consumer))
    for i, request in enumerate(_requests(f"{producer}to{consumer}", seed)):
        result, handle = ray.get(prefill.prefill_pull.remote(request))
        assert len(handle.ranks) == (producer if producer > 1 else 0)
        outputs = ray.get(decode.decode_pull.remote(request, handle, result.first_logprobs))
        trace = same_output.trace_from_outputs(outputs)
        expected = reference[f"ref{seed}-{i}"]
        same_output.assert_same_output(expected, trace, exact=False, label=f"{producer} -> {consumer} #{i}")
        blocks = -(-len(request.prompt_token_ids) // BLOCK_SIZE)
        per_rank = LAYERS * 2 * blocks * BLOCK_SIZE * (KV_HEADS // consumer) * HEAD_DIM * 4
        moved = ray.get(decode.last_fetch_rank_bytes.remote())  # by rank; () from a one-rank consumer
        assert moved == ((per_rank,) * consumer if consumer > 1 else ())
        assert ray.get(decode.last_fetch_bytes.remote()) == per_rank * consumer
    for actor in (prefill, decode):
        stats = ray.get(actor.stats.remote())
        assert (stats.num_pinned_blocks, stats.num_reserved_blocks, stats.num_running) == (0, 0, 0)
