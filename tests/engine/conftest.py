"""Engine test helpers: engines that check their pool on teardown, HF references, prompts."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loader import LoadedModel, ModelSpec, load_model
from engine.params import GenerationRequest, RequestOutput, SamplingParams
from tests import same_output
from tests.same_output import GreedyTrace
from tests.tiny_models import TinyServed, tiny_config
from workloads.corpus import CHAT_QUESTIONS, prompt_of_length

NUM_COMPARED = 32
# up to 40 blocks of 16 and over one 512-token chunk; longer prompts add prefill time, not cases
PROMPT_LENGTHS = (1, 9, 120, 300, 640)


def greedy(max_tokens: int = NUM_COMPARED) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=5)


def assert_pool_idle(core: EngineCore) -> None:
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    assert (stats.num_pinned_blocks, stats.num_reserved_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0, 0)
    core.allocator.check()  # free + cached (evictable) + in use == total, keys consistent


@pytest.fixture
def make_engine() -> Iterator[Callable[..., EngineCore]]:
    """Build engines; after the test every engine must have all its blocks free again."""
    made: list[EngineCore] = []

    def build(loaded: LoadedModel, **config: object) -> EngineCore:
        config.setdefault("max_model_len", 2048)
        config.setdefault("kv_cache_bytes", 160 << 20)
        core = EngineCore(loaded, EngineConfig(**config))
        made.append(core)
        return core

    yield build
    for core in made:
        assert_pool_idle(core)


def run_to_completion(core: EngineCore, arrivals: dict[int, list[GenerationRequest]]) -> dict[str, list[RequestOutput]]:
    """Step until idle, adding ``arrivals[k]`` before step k; returns outputs per request."""
    outputs: dict[str, list[RequestOutput]] = {}
    step = 0
    while core.has_work() or any(k >= step for k in arrivals):
        for request in arrivals.get(step, []):
            core.add_request(request)
            outputs[request.request_id] = []
        for out in core.step():
            outputs[out.request_id].append(out)
        step += 1
    return outputs


def hf_greedy(loaded: LoadedModel, prompt: list[int], num_tokens: int = NUM_COMPARED) -> GreedyTrace:
    return same_output.hf_greedy(loaded.model, prompt, num_tokens)


@pytest.fixture(scope="session")
def smol_prompts(smol: LoadedModel) -> list[list[int]]:
    """6 prompts of 1 to 640 tokens: corpus slices and a chat-templated question."""
    tok = smol.tokenizer
    prompts = [prompt_of_length(tok, n, offset=17 * i) for i, n in enumerate(PROMPT_LENGTHS)]
    chat = tok.apply_chat_template([{"role": "user", "content": CHAT_QUESTIONS[0]}], add_generation_prompt=True)
    prompts.insert(2, list(chat["input_ids"] if hasattr(chat, "keys") else chat))
    return prompts


@pytest.fixture(scope="session")
def smol_hf_traces(smol_reference: LoadedModel, smol_prompts: list[list[int]]) -> list[GreedyTrace]:
    return [hf_greedy(smol_reference, p) for p in smol_prompts]


@pytest.fixture(scope="session")
def tiny_hf_traces(tiny_served: TinyServed, smol_prompts: list[list[int]]) -> list[GreedyTrace]:
    """``smol_prompts``' references on the tiny model of the default model's architecture and
    tokenizer (``tiny_served.loaded`` is its engine copy): for the chunked and staggered
    variants, whose subject is the scheduling (the default model's own tokens: ``smol_hf_traces``)."""
    reference = load_model(ModelSpec(source=tiny_served.args["model.source"]))
    reference.model.generation_config.eos_token_id = None
    return [hf_greedy(reference, p) for p in smol_prompts]


def tiny_loaded(family: str, seed: int = 0, initializer_range: float = 0.02) -> tuple[LoadedModel, LoadedModel]:
    """A random-weight model of a real family, twice (engine copy, reference copy)."""
    config = tiny_config(family, initializer_range)
    pair = []
    for _ in range(2):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        pair.append(LoadedModel(model=model, tokenizer=None, name=f"tiny-{family}"))
    return pair[0], pair[1]
