"""KV between tensor-parallel engines of different degrees, pull and push, over real NIXL.

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
from tests.waiting import wait_until

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
def engines(shared_ray, spec):
    from bench.engine_actor import EngineActor

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
CASES = [(mode, producer, consumer) for mode in ("pull", "push") for producer, consumer in PAIRS]


@pytest.fixture(scope="module")
def reference(spec) -> dict[str, same_output.GreedyTrace]:
    """One rank, one process: the tokens every case must give (every case's prompts)."""
    core = EngineCore.from_spec(spec, EngineConfig(**SETTINGS))
    requests = [r for seed in range(len(CASES)) for r in _requests(f"ref{seed}", seed)]
    outputs = run_to_completion(core, {0: requests})
    return {rid: same_output.trace_from_outputs(outs) for rid, outs in outputs.items()}


def _move(mode: str, prefill, decode, request: GenerationRequest) -> tuple[list, tuple[int, ...], int]:
    """One request prefilled by ``prefill`` and decoded by ``decode``: its outputs, the bytes each
    rank moved (by rank: the consumer's for a pull, the producer's for a push; () for one rank)
    and the bytes moved in all."""
    if mode == "pull":
        result, handle = ray.get(prefill.prefill_pull.remote(request))
        assert len(handle.ranks) == ray.get(prefill.ranks.remote())
        outputs = ray.get(decode.decode_pull.remote(request, handle, result.first_logprobs))
        return outputs, ray.get(decode.last_fetch_rank_bytes.remote()), ray.get(decode.last_fetch_bytes.remote())
    destination = ray.get(decode.reserve_push.remote(request))
    assert len(destination.ranks) == ray.get(decode.ranks.remote())
    decoded = decode.decode_push.remote(request, destination)
    _, stats = ray.get(prefill.prefill_push.remote(request, destination))
    return ray.get(decoded), stats.rank_bytes, stats.num_bytes


def _wait_idle(*actors) -> None:
    """Nothing pinned, reserved or running on any: a pull's export is unpinned by the consumer's
    notice, asynchronously (blocks a prefix cache keeps are not held)."""

    def held() -> list[tuple[int, int, int]]:
        return [
            (s.num_pinned_blocks, s.num_reserved_blocks, s.num_running)
            for s in ray.get([a.stats.remote() for a in actors])
        ]

    wait_until(held, 10, "nothing pinned, reserved or running", until=lambda all_held: set(all_held) == {(0, 0, 0)})


@pytest.mark.parametrize(("mode", "producer", "consumer"), CASES)
def test_kv_between_degrees_gives_one_rank_s_tokens_and_each_rank_moves_its_heads(
    engines, reference, mode, producer, consumer
):
    prefill, decode = engines[producer], engines[consumer]
    seed = CASES.index((mode, producer, consumer))
    mover = consumer if mode == "pull" else producer  # the side whose ranks post the transfers
    for i, request in enumerate(_requests(f"{mode}{producer}to{consumer}", seed)):
        outputs, rank_bytes, total = _move(mode, prefill, decode, request)
        trace = same_output.trace_from_outputs(outputs)
        expected = reference[f"ref{seed}-{i}"]
        same_output.assert_same_output(expected, trace, exact=False, label=f"{mode} {producer} -> {consumer} #{i}")
        blocks = -(-len(request.prompt_token_ids) // BLOCK_SIZE)
        every_head = LAYERS * 2 * blocks * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4
        assert total == every_head  # no KV head is replicated at these degrees: each moves once
        assert rank_bytes == ((every_head // mover,) * mover if mover > 1 else ())
    _wait_idle(prefill, decode)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_only_the_blocks_the_consumer_s_prefix_cache_lacks_move(engines, mode):
    """A prompt whose first 4 blocks the TP-4 consumer holds from an earlier request: only its
    last 2 blocks move from the TP-2 producer, and the tokens are the one-rank engine's."""
    prefill, decode, one_rank = engines[2], engines[4], engines[1]
    shared = [(7 * j + (mode == "push") * 13) % 500 + 1 for j in range(4 * BLOCK_SIZE)]
    first = GenerationRequest(f"{mode}-prefix-a", (*shared, *range(300, 308)), greedy())
    second = GenerationRequest(f"{mode}-prefix-b", (*shared, *range(400, 412)), greedy())  # 44 tokens: 6 blocks
    block_bytes = LAYERS * 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4
    for request, moved_blocks in ((first, 5), (second, 2)):
        outputs, _, total = _move(mode, prefill, decode, request)
        assert total == moved_blocks * block_bytes
        expected = same_output.trace_from_outputs(ray.get(one_rank.generate.remote(request)))
        same_output.assert_same_output(expected, same_output.trace_from_outputs(outputs), exact=False, label=mode)
