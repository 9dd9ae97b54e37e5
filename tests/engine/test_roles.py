"""Prefill role then decode role (KV handed over in process) against the ``both`` role."""

from __future__ import annotations

import pytest

from engine.params import FinishReason, GenerationRequest, PrefillResult, Role, RoleError, SamplingParams
from tests.engine.conftest import greedy, run_to_completion, tiny_loaded
from tests.same_output import assert_same_output, trace_from_outputs
from tests.tiny_models import SHARP, random_ids


def _prefill(core, request) -> PrefillResult:
    core.add_prefill(request)
    outputs = []
    while core.has_work():
        outputs += core.step()
    (final,) = outputs
    return PrefillResult.from_output(final)


def _handover(prefill_core, decode_core, request):
    result = _prefill(prefill_core, request)
    assert result.finish_reason is None
    assert prefill_core.stats().num_pinned_blocks == len(result.block_ids) > 0
    blocks = decode_core.reserve(request.request_id, result.num_tokens)
    assert len(blocks) == len(result.block_ids)
    decode_core.pool.copy_blocks_from(prefill_core.pool, list(result.block_ids), blocks)
    assert prefill_core.release(request.request_id)
    decode_core.add_decode(request, blocks, result.first_token, result.first_logprobs)
    outputs = []
    while decode_core.has_work():
        outputs += [o for o in decode_core.step() if o.request_id == request.request_id]
    assert len([lp for o in outputs for lp in o.logprobs]) == len([t for o in outputs for t in o.token_ids])
    return result, outputs


def test_prefill_then_decode_equals_both(smol, smol_prompts, smol_hf_traces, make_engine):
    prefill_core = make_engine(smol, role=Role.PREFILL)
    decode_core = make_engine(smol, role=Role.DECODE)
    for i in (0, 2, 5):
        request = GenerationRequest(f"pd-{i}", tuple(smol_prompts[i]), greedy())
        result, outputs = _handover(prefill_core, decode_core, request)
        assert result.num_tokens == len(smol_prompts[i])
        got = trace_from_outputs(outputs)
        assert got.tokens[0] == result.first_token == smol_hf_traces[i].tokens[0]
        assert_same_output(smol_hf_traces[i], got, exact=True, label=f"handover {i}")
        assert outputs[-1].num_output_tokens == 32 and outputs[-1].num_prompt_tokens == len(smol_prompts[i])


def test_prefill_that_ends_at_its_first_token_frees_its_blocks(smol, make_engine):
    core = make_engine(smol, role=Role.PREFILL)
    request = core.make_request("Hello", SamplingParams(max_tokens=1, temperature=0))
    result = _prefill(core, request)
    assert result.finish_reason is FinishReason.LENGTH and result.block_ids == ()
    assert core.stats().num_pinned_blocks == 0


def test_roles_gate_admission_and_can_flip(smol, make_engine):
    core = make_engine(smol, role=Role.PREFILL)
    request = core.make_request("Hi there", SamplingParams(max_tokens=4, temperature=0))
    with pytest.raises(RoleError, match="role 'prefill' does not accept generate"):
        core.add_request(request)
    with pytest.raises(RoleError, match="does not accept reserve"):
        core.reserve("x", 10)
    core.set_role(Role.DECODE)
    with pytest.raises(RoleError, match="role 'decode' does not accept prefill"):
        core.add_prefill(request)
    outputs = run_to_completion(core, {0: [request]})
    assert outputs[request.request_id][-1].num_output_tokens == 4
    assert core.stats().role is Role.DECODE


def test_reserve_refuses_when_full_and_release_frees(smol, make_engine):
    core = make_engine(smol, role=Role.DECODE, max_model_len=256, num_blocks=20)
    assert core.reserve("a", 256) == list(range(16))
    assert core.reserve("b", 100) is None  # needs 7 blocks, 4 free
    assert core.reserve("c", 64) == [16, 17, 18, 19]
    assert core.stats().num_reserved_blocks == 20
    with pytest.raises(ValueError, match="were not reserved"):
        core.add_decode(core.make_request([1, 2, 3]), [5], first_token=1)
    assert core.release("a") and core.abort("c")
    assert not core.release("a")


def test_abort_during_decode_frees_everything(smol, make_engine):
    prefill_core = make_engine(smol, role=Role.PREFILL)
    decode_core = make_engine(smol, role=Role.DECODE)
    request = prefill_core.make_request(
        "Tell me a story about a dragon.", SamplingParams(max_tokens=50, ignore_eos=True)
    )
    result = _prefill(prefill_core, request)
    blocks = decode_core.reserve(request.request_id, result.num_tokens)
    decode_core.add_decode(request, blocks, result.first_token)
    decode_core.step()
    assert decode_core.abort(request.request_id)
    assert prefill_core.abort(request.request_id)  # the pinned producer side
    (out,) = decode_core.step()
    assert out.finished and out.finish_reason is FinishReason.ABORT


def test_a_decode_pool_too_small_for_its_handed_over_requests_recomputes_one_and_all_finish(make_engine):
    """Four handed-over requests of 90 tokens fill a 26-block decode pool; each needs more
    blocks to go on, and KV from another replica is not preempted, so all four stall. The
    newest is then recomputed on the decode replica: all four finish with the tokens of the
    ``both`` role (a sharp tiny model: a wrong block would change them)."""
    loaded, _ = tiny_loaded("llama", 0, SHARP)
    sampling = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    requests = [GenerationRequest(f"small-{i}", tuple(random_ids(90, i)), sampling) for i in range(4)]
    expected = run_to_completion(make_engine(loaded, max_model_len=256), {0: requests})
    prefill_core = make_engine(loaded, role=Role.PREFILL, max_model_len=256)
    decode_core = make_engine(loaded, role=Role.DECODE, max_model_len=256, num_blocks=26)
    for request in requests:
        result = _prefill(prefill_core, request)
        blocks = decode_core.reserve(request.request_id, result.num_tokens)
        decode_core.pool.copy_blocks_from(prefill_core.pool, list(result.block_ids), blocks)
        assert prefill_core.release(request.request_id)
        decode_core.add_decode(request, blocks, result.first_token, result.first_logprobs)
    outputs: dict[str, list] = {}
    while decode_core.has_work():
        for out in decode_core.step():
            outputs.setdefault(out.request_id, []).append(out)
    for request in requests:
        got, want = outputs[request.request_id], expected[request.request_id]
        assert got[-1].finish_reason is FinishReason.LENGTH, got[-1].error
        assert [t for o in got for t in o.token_ids] == [t for o in want for t in o.token_ids], request.request_id
    assert decode_core.stats().num_preemptions == 1
