"""CUDA-graph decode on CPU: which steps replay and at what padded size, the static inputs
exactly, and the whole replay path (static buffers, padding rows, masks) through the real
engine with ``FakeCudaGraph`` standing in for the GPU's graph. tests/gpu has the real one."""

from __future__ import annotations

import pydantic
import pytest
import torch
from transformers import AutoModelForCausalLM, Phi3Config

from engine.config import EngineConfig, EngineSettings, SpeculativeConfig
from engine.core import EngineCore
from engine.cuda_graphs import DecodeGraphs, GraphKey, batch_bucket, blocks_bucket, decode_inputs, graph_key
from engine.decode_kernels import DecodeKernels
from engine.fused_decode import FusedDecode, unsupported
from engine.fused_linear import fuse_projections
from engine.params import GenerationRequest, SamplingParams
from engine.scheduler import ScheduledChunk
from tests.engine.conftest import greedy, run_to_completion, tiny_loaded
from tests.tiny_models import SHARP

SIZES = (1, 2, 4, 8)


class FakeCudaGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` (there is no GPU here): ``capture`` runs the step
    once and keeps it, ``replay`` runs it again on the static inputs' current values and
    writes the captured output tensor in place, as a real replay does."""

    def __init__(self, pool: object) -> None:
        self.fn = None
        self.out: torch.Tensor | None = None
        self.num_replays = 0

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())
        self.num_replays += 1


def _decode(rid: str, pos: int, blocks: tuple[int, ...], token: int = 7) -> ScheduledChunk:
    return ScheduledChunk(rid, (token,), pos, blocks, sample=True)


def test_batches_pad_up_to_the_next_size_and_larger_ones_run_eagerly():
    assert [batch_bucket(n, SIZES) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert batch_bucket(0, SIZES) is None
    assert [blocks_bucket(n, 100) for n in (1, 2, 3, 5, 16, 17, 64, 65, 100)] == [1, 2, 4, 8, 16, 32, 64, 100, 100]
    assert blocks_bucket(101, 100) is None


def test_only_pure_decode_steps_replay():
    decode = [_decode("a", 20, (3, 4)), _decode("b", 40, (5, 6, 9))]  # 21 and 41 tokens: 2 and 3 blocks
    assert graph_key(decode, 16, SIZES, 100) == GraphKey(batch=2, num_blocks=4)
    prefill = ScheduledChunk("c", (1, 2, 3), 0, (8,), sample=True)
    assert graph_key([*decode, prefill], 16, SIZES, 100) is None
    unsampled = ScheduledChunk("d", (5,), 9, (8,), sample=False)
    assert graph_key([*decode, unsampled], 16, SIZES, 100) is None
    assert graph_key([_decode(str(i), 3, (i,)) for i in range(9)], 16, SIZES, 100) is None  # 9 > 8
    assert graph_key([_decode("long", 16 * 100, tuple(range(101)))], 16, SIZES, 100) is None  # 101 blocks


def test_static_inputs_are_padded_with_row_zero_and_block_zero():
    chunks = [_decode("a", 17, (3, 4), token=11), _decode("b", 5, (9,), token=12), _decode("c", 33, (1, 2, 6), 13)]
    key = graph_key(chunks, 16, SIZES, 100)
    assert key == GraphKey(batch=4, num_blocks=4)
    flat = decode_inputs(chunks, key, 16)
    assert flat[:4] == [11, 12, 13, 11]  # token ids: the padding row repeats row 0
    assert flat[4:8] == [17, 5, 33, 17]  # positions
    assert flat[8:12] == [4 * 16 + 1, 9 * 16 + 5, 6 * 16 + 1, 4 * 16 + 1]  # slots: row 0's again
    assert flat[12:16] == [18, 6, 34, 18]  # context lengths
    assert flat[16:] == [3, 4, 0, 0, 9, 0, 0, 0, 1, 2, 6, 0, 3, 4, 0, 0]  # tables, 4 blocks each


def test_verify_steps_replay_with_their_queries_padded_to_a_power_of_two():
    """A last token and three proposals (positions 20-23) beside a plain decode row: 4 queries
    per row, the decode row repeating its one query; without verify graphs it runs eagerly."""
    verify = ScheduledChunk("v", (5, 6, 7, 8), 20, (3, 4), sample=True, num_draft=3)
    decode = _decode("d", 9, (8,), token=11)
    assert graph_key([verify, decode], 16, SIZES, 100) is None  # no speculation: no verify graphs
    assert graph_key([verify, decode], 16, SIZES, 100, max_queries=3) is None  # more queries than that
    key = graph_key([verify, decode], 16, SIZES, 100, max_queries=4)
    assert key == GraphKey(batch=2, num_blocks=2, num_queries=4)
    flat = decode_inputs([verify, decode], key, 16)
    assert flat[:8] == [5, 6, 7, 8, 11, 11, 11, 11]  # token ids
    assert flat[8:16] == [20, 21, 22, 23, 9, 9, 9, 9]  # positions
    assert flat[16:24] == [4 * 16 + 4, 4 * 16 + 5, 4 * 16 + 6, 4 * 16 + 7] + [8 * 16 + 9] * 4  # slots
    assert flat[24:32] == [21, 22, 23, 24, 10, 10, 10, 10]  # each query sees up to its own position
    assert flat[32:] == [3, 4, 8, 0]
    three = ScheduledChunk("w", (1, 2, 3), 40, (1, 2, 5), sample=True, num_draft=2)
    assert graph_key([three], 16, SIZES, 100, max_queries=5) == GraphKey(batch=1, num_blocks=4, num_queries=4)
    five = ScheduledChunk("f", (1, 2, 3, 4, 5), 40, (1, 2, 5), sample=True, num_draft=4)
    assert graph_key([five], 16, SIZES, 6, max_queries=5).num_queries == 5  # 8 would pass the most there is
    padded = graph_key([three, decode, verify], 16, SIZES, 6, max_queries=5)
    assert padded == GraphKey(batch=4, num_blocks=4, num_queries=4)  # 43 tokens: 3 blocks, then 4 (of at most 6)
    flat = decode_inputs([three, decode, verify], padded, 16)
    assert flat[:16] == [1, 2, 3, 3, 11, 11, 11, 11, 5, 6, 7, 8, 1, 2, 3, 3]  # the padding row repeats row 0
    assert flat[-4:] == [1, 2, 5, 0]  # and its table


def test_graphs_need_a_cuda_device_or_a_given_graph_type_and_valid_sizes():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, not cpu"):
        DecodeGraphs(lambda s: s, torch.device("cpu"), 16, 10)
    with pytest.raises(ValueError, match="batch sizes must be positive"):
        DecodeGraphs(lambda s: s, torch.device("cpu"), 16, 10, (0, 4), graph_type=FakeCudaGraph)
    with pytest.raises(pydantic.ValidationError, match="cuda_graph_batch_sizes"):
        EngineSettings(cuda_graph_batch_sizes=(0, 2))
    assert EngineSettings().graph_batch_sizes() == (1, 2, 4, 8, 16, 32, 64)
    assert EngineSettings(cuda_graph_batch_sizes=(8, 1, 8)).graph_batch_sizes() == (1, 8)
    assert EngineSettings(cuda_graphs=False).graph_batch_sizes() is None


def _generate(core: EngineCore, prompts: list[list[int]], num_tokens: list[int]) -> dict[str, list[int]]:
    requests = [GenerationRequest(f"r{i}", tuple(p), greedy(n)) for i, (p, n) in enumerate(zip(prompts, num_tokens))]
    outputs = run_to_completion(core, {0: requests})
    return {rid: [t for out in outs for t in out.token_ids] for rid, outs in outputs.items()}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_replayed_decode_gives_the_eager_tokens(make_engine, family):
    """Three sequences that end one after another (batches of 3, 2 and 1, padded to 4, 2 and 1)
    and whose contexts cross block boundaries: every decode step replays, and the tokens are
    the eager engine's."""
    loaded, twin = tiny_loaded(family)
    prompts = [[(5 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((3, 14, 28))]
    num_tokens = [8, 16, 24]
    eager = _generate(make_engine(twin, block_size=8, max_model_len=256), prompts, num_tokens)
    core = make_engine(loaded, block_size=8, max_model_len=256)
    core.runner.use_cuda_graphs(SIZES, graph_type=FakeCudaGraph)
    replayed = _generate(core, prompts, num_tokens)
    assert replayed == eager
    assert [len(tokens) for tokens in replayed.values()] == num_tokens
    graphs = core.runner.graphs
    assert {k.batch for k in graphs.captured} == {4, 2, 1}
    assert {k.num_blocks for k in graphs.captured} == {4, 8}  # the longest context: 29 to 51 tokens
    assert graphs.num_replays == core.num_model_steps - 1  # every step but the prompts' one


def test_verify_steps_replay_and_give_the_eager_speculative_tokens(make_engine):
    """Speculative decoding with every step after the prompts replayed, verify steps included
    (rows with and without proposals, three and fewer): the eager engine's tokens and the same
    proposals accepted."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    prompts = [[1, 2, 3, 4, 5, 6] * 4, [(5 * j) % 97 + 1 for j in range(13)], [7, 8, 9] * 5]
    num_tokens = [20, 24, 16]
    loaded, twin = tiny_loaded("llama", initializer_range=SHARP)
    eager_core = make_engine(twin, block_size=8, max_model_len=256, speculative=spec)
    eager = _generate(eager_core, prompts, num_tokens)
    core = make_engine(loaded, block_size=8, max_model_len=256, speculative=spec)
    core.runner.use_cuda_graphs(SIZES, graph_type=FakeCudaGraph)
    assert _generate(core, prompts, num_tokens) == eager
    assert core.spec_counters == eager_core.spec_counters and core.spec_counters.num_drafts > 0
    assert {k.num_queries for k in core.runner.graphs.captured} >= {1, 4}
    assert core.runner.graphs.num_replays == core.num_model_steps - 1


def test_a_verify_graph_that_fails_to_capture_leaves_verify_steps_eager(make_engine, caplog):
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    prompts, num_tokens = [[1, 2, 3, 4, 5, 6] * 4, [7, 8, 9] * 5], [20, 16]
    loaded, twin = tiny_loaded("llama", initializer_range=SHARP)
    eager = _generate(make_engine(twin, block_size=8, max_model_len=256, speculative=spec), prompts, num_tokens)
    core = make_engine(loaded, block_size=8, max_model_len=256, speculative=spec)
    core.runner.use_cuda_graphs(SIZES, graph_type=FakeCudaGraph)

    def uncapturable(static: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    core.runner.graphs._verify_forward = uncapturable  # as a model whose verify forward syncs the host
    assert _generate(core, prompts, num_tokens) == eager
    assert core.spec_counters.num_drafts > 0 and core.runner.graphs.max_queries == 1
    assert {k.num_queries for k in core.runner.graphs.captured} == {1}  # decode steps still replay
    assert "verify steps run eagerly: their CUDA graph failed to capture" in caplog.text


def test_verify_steps_replay_with_seeded_sampling_and_logprobs(make_engine):
    """Temperature sampling with a seed and logprobs through verify graphs: the eager engine's
    tokens, and the same log-probabilities but for the last bits."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    sampling = SamplingParams(max_tokens=24, temperature=0.7, seed=5, ignore_eos=True, logprobs=2)
    requests = [GenerationRequest(f"s{i}", tuple(p), sampling) for i, p in enumerate(([4, 5, 6] * 6, [9, 8] * 7))]
    loaded, twin = tiny_loaded("llama", initializer_range=SHARP)
    eager = run_to_completion(make_engine(twin, block_size=8, max_model_len=256, speculative=spec), {0: requests})
    core = make_engine(loaded, block_size=8, max_model_len=256, speculative=spec)
    core.runner.use_cuda_graphs(SIZES, graph_type=FakeCudaGraph)
    got = run_to_completion(core, {0: requests})
    assert core.spec_counters.num_drafts > 0 and any(k.num_queries > 1 for k in core.runner.graphs.captured)
    for rid, outputs in eager.items():
        assert [o.token_ids for o in got[rid]] == [o.token_ids for o in outputs]
        values = [lp.logprob for o in got[rid] for lp in o.logprobs]
        assert values == pytest.approx([lp.logprob for o in outputs for lp in o.logprobs], abs=1e-4)


def test_with_a_layer_hook_prompt_steps_run_eagerly_and_decode_steps_replay(make_engine):
    """A push's layer hook writes prompt chunks: those steps run eagerly and call it; decode
    steps (no prompt token) still replay, calling no hook (a graph runs no Python)."""
    loaded, _ = tiny_loaded("llama")
    core = make_engine(loaded, block_size=8, max_model_len=256)
    core.runner.use_cuda_graphs(SIZES, graph_type=FakeCudaGraph)
    seen: list[tuple[int, bool]] = []
    core.runner.add_layer_hook(lambda layer, chunks: seen.append((layer, chunks[0].in_prompt)))
    _generate(core, [[1, 2, 3, 4, 5]], [4])
    assert seen == [(0, True), (1, True), (2, True)]  # the prompt's step only
    assert core.runner.graphs.num_replays == core.num_model_steps - 1 == 3
    core.runner.use_cuda_graphs(None)
    assert core.runner.graphs is None
    assert EngineConfig().cuda_graphs is True


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_decode_steps_give_the_eager_tokens(make_engine, family):
    """``engine.fused_decode`` on ``DecodeKernels(triton=False)`` (the arithmetic the Triton kernels are
    tested against in tests/gpu): the same replayed steps as above, the eager engine's tokens,
    and the K/V it wrote into the pool are the eager engine's too."""
    loaded, twin = tiny_loaded(family, initializer_range=SHARP)
    prompts = [[(5 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((3, 14, 28))]
    num_tokens = [8, 16, 24]
    eager_core = make_engine(twin, block_size=8, max_model_len=256)
    eager = _generate(eager_core, prompts, num_tokens)
    # synchronous steps: an asynchronous one also writes a finished request's last token's K/V
    core = make_engine(loaded, block_size=8, max_model_len=256, async_scheduling="off")
    core.runner.use_cuda_graphs(SIZES, graph_type=FakeCudaGraph, kernels=DecodeKernels(triton=False))
    assert core.runner.fused_decode is not None
    fused = _generate(core, prompts, num_tokens)
    assert fused == eager
    assert core.runner.graphs.num_replays == core.num_model_steps - 1
    # the fused and eager steps sum in different orders, and how float32 rounds then depends on the
    # CPU's matrix kernels (AVX-512 unlike AVX2): a few ulps of K/V that reach 32 here; a K/V
    # written to a wrong slot, head or position would be off by far more
    torch.testing.assert_close(core.pool.tensor, eager_core.pool.tensor, rtol=1e-5, atol=1e-4)


def test_fused_decode_names_what_it_cannot_run():
    phi3 = Phi3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)  # fmt: skip
    decoder = AutoModelForCausalLM.from_config(phi3).model
    assert unsupported(decoder) == (
        "Phi3DecoderLayer is not one of LlamaDecoderLayer, Qwen2DecoderLayer, Qwen3DecoderLayer, MistralDecoderLayer"
    )
    llama, _ = tiny_loaded("llama")
    assert unsupported(llama.model.model) == "projections not fused"  # before the engine's layout
    fuse_projections(llama.model)
    assert unsupported(llama.model.model) is None
    gelu, _ = tiny_loaded("qwen3")
    gelu.model.config.hidden_act = "gelu"
    fuse_projections(gelu.model)
    assert unsupported(gelu.model.model) == "activation 'gelu'"
    with pytest.raises(ValueError, match="fused decode kernels cannot run this model: Phi3DecoderLayer"):
        FusedDecode(decoder, llama.model.lm_head, None, DecodeKernels(triton=False))
