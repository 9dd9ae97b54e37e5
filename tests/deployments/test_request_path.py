"""One request's path through fake replicas (no Ray): the steps in order, the retry and the
fallback, the bounds, and every unfinished replica call cancelled however the request ends."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from ray.serve.exceptions import ReplicaUnavailableError

from app.settings import AppConfig
from deployments.elastic_routing import ElasticRouting, Route
from deployments.http_errors import HTTPError, ReplicaFailure
from deployments.request_path import RequestPath
from engine.params import GenerationRequest, PrefillResult, RequestOutput, RoleError, SamplingParams
from kv_transport.base import KVTransferError

HANG = "hang"  # a stream item or call result that never comes


def _output(rid: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id=rid, token_ids=(token,), text=str(token), finished=finished)


def _prefilled(rid: str, cached: int = 0) -> PrefillResult:
    fields = {"first_token": 1, "block_ids": (0,), "num_tokens": 4, "first_text": "1", "compute_s": 0.4}
    return PrefillResult(request_id=rid, num_cached_tokens=cached, **fields)


async def _outcome(item: Any) -> Any:
    if item == HANG:
        await asyncio.Event().wait()
    if isinstance(item, BaseException):
        raise item
    return item


class Stream:
    """A replica stream as Serve hands it to the ingress: ``__anext__`` and ``cancel``."""

    def __init__(self, items: list) -> None:
        self.items, self.cancelled = list(items), False

    async def __anext__(self) -> Any:
        await asyncio.sleep(0)
        if not self.items:
            raise StopAsyncIteration
        return await _outcome(self.items.pop(0))

    def cancel(self) -> None:
        self.cancelled = True


class Call:
    """A replica call as Serve hands it to the ingress: awaitable once, and ``cancel``."""

    def __init__(self, outcome: Any) -> None:
        self.outcome, self.cancelled = outcome, False

    def __await__(self):
        return _outcome(self.outcome).__await__()

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class Deployment:
    """A deployment handle: each method answers from its script, in order; calls are kept."""

    scripts: dict[str, list] = field(default_factory=dict)
    calls: list[tuple[str, str, Any]] = field(default_factory=list)  # (method, request id, Stream or Call)

    def options(self, stream: bool = False) -> Deployment:
        return self

    def __getattr__(self, method: str) -> Any:
        deployment = self

        class Method:
            @staticmethod
            def remote(request: GenerationRequest | str, *args: Any) -> Any:  # a request, or a KV handle
                script = deployment.scripts[method].pop(0)
                made = Stream(script) if isinstance(script, list) else Call(script)
                deployment.calls.append((method, getattr(request, "request_id", request), made))
                return made

        return Method()


class Metrics:
    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.prefill_hop = self.retries = self.requests = self

    def observe(self, *args: Any) -> None:
        self.events.append(("observe", *args))

    def inc(self, n: int, tags: dict) -> None:
        self.events.append(("inc", tags))


class FixedRouting(ElasticRouting):
    """The elastic routing's counting, with the route fixed (no controller, no sync)."""

    def __init__(self, route: Route) -> None:
        super().__init__(controller=None, policy=None)
        self.fixed, self.samples = route, []

    def route(self, prompt_tokens: int, output_tokens: int) -> Route:
        return self.fixed

    def observe(self, *sample: Any) -> None:
        self.samples.append(sample)


REQUEST = GenerationRequest("r", (5, 6, 7, 8), SamplingParams(max_tokens=3))


def _path(settings: dict | None = None, elastic: ElasticRouting | None = None, **deployments: Deployment):
    config = AppConfig.model_validate(settings or {})
    return RequestPath(config, Metrics(), elastic=elastic, **deployments)


def _run(path: RequestPath, request: GenerationRequest = REQUEST, take: int | None = None) -> list[RequestOutput]:
    """The request's outputs; with ``take``, the client leaves after that many."""

    async def main() -> list[RequestOutput]:
        outputs, got = path.outputs(request), []
        try:
            async for output in outputs:
                got.append(output)
                if take is not None and len(got) == take:
                    break
        finally:
            await outputs.aclose()
        return got

    return asyncio.run(main())


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def test_pull_prefills_then_streams_the_decode_with_the_prefill_cache_counted():
    prefill = Deployment({"prefill": [(_prefilled("r", cached=2), "handle")]})
    decode = Deployment({"decode_pull": [[_output("r", 2), _output("r", 3, finished=True)]]})
    path = _path(prefill=prefill, decode=decode)
    outputs = _run(path)
    assert _tokens(outputs) == [2, 3] and [o.num_cached_tokens for o in outputs] == [2, 2]
    assert [c[0] for c in prefill.calls + decode.calls] == ["prefill", "decode_pull"]
    assert not decode.calls[0][2].cancelled and not prefill.calls[0][2].cancelled
    assert [e[0] for e in path.metrics.events] == ["observe", "observe", "inc"]  # hop, latencies, 200
    assert path.metrics.events[-1] == ("inc", {"status": "200"})


def test_push_reads_the_destination_then_streams_while_the_prefill_writes():
    prefill = Deployment({"prefill_push": [(_prefilled("r", cached=4), "stats")]})
    decode = Deployment({"decode_push": [["destination", _output("r", 2), _output("r", 3, finished=True)]]})
    elastic = FixedRouting(Route.DISAGGREGATED)
    path = _path({"transport": {"mode": "push"}}, elastic, prefill=prefill, decode=decode)
    outputs = _run(path)
    assert _tokens(outputs) == [2, 3]
    assert [o.num_cached_tokens for o in outputs] == [0, 4]  # the last waits for the prefill's figures
    assert elastic.book.seconds_per_prompt_token == pytest.approx(0.1)  # 0.4 s over 4 prompt tokens
    ((ttft_s, tpot_s, prefill_s),) = elastic.samples
    assert prefill_s == ttft_s  # push: the prefill call ends with the transfer
    assert elastic.book.in_flight[Route.DISAGGREGATED] == 0 and elastic.book.prefill_tokens == 0


def test_a_failed_push_is_retried_on_the_decode_replica_and_both_calls_are_cancelled():
    failure = KVTransferError("push failed", "r", "p0")
    prefill = Deployment({"prefill_push": [failure]})
    decode = Deployment({"decode_push": [["destination", HANG]], "generate": [[_output("r-retry", 2, finished=True)]]})
    path = _path({"transport": {"mode": "push"}}, FixedRouting(Route.DISAGGREGATED), prefill=prefill, decode=decode)
    assert _tokens(_run(path)) == [2]
    (_, _, push), (_, retry_id, _) = decode.calls
    assert push.cancelled and prefill.calls[0][2].cancelled
    assert retry_id == "r-retry"
    assert ("inc", {"side": "prefill"}) in path.metrics.events


def test_a_decode_replica_gone_after_an_output_ends_the_request_with_a_503():
    gone = ReplicaUnavailableError("d0")
    decode = Deployment({"generate": [[_output("r", 2), gone]]})
    path = _path({"disagg_min_prompt_tokens": 8}, decode=decode)  # a short prompt: prefilled on decode
    with pytest.raises(ReplicaFailure) as failed:
        _run(path)
    assert failed.value.status == 503 and failed.value.side == "decode"
    assert len(decode.calls) == 1 and decode.calls[0][2].cancelled


def test_a_stream_without_output_past_the_idle_bound_ends_with_a_504_and_is_cancelled():
    colocated = Deployment({"generate": [[HANG]]})
    path = _path({"limits": {"stream_idle_timeout_s": 0.05}}, colocated=colocated)
    with pytest.raises(HTTPError) as failed:
        _run(path)
    assert failed.value.status == 504 and failed.value.body["error"]["code"] == "timeout"
    assert colocated.calls[0][2].cancelled


def test_a_pull_prefill_without_answer_past_the_idle_bound_is_cancelled():
    """The prefill call is cancelled too (its replica aborts the prompt and frees its blocks,
    instead of exporting KV nobody fetches until the lease ends)."""
    prefill = Deployment({"prefill": [HANG]})
    path = _path({"limits": {"stream_idle_timeout_s": 0.05}}, prefill=prefill, decode=Deployment())
    with pytest.raises(HTTPError) as failed:
        _run(path)
    assert failed.value.status == 504 and prefill.calls[0][2].cancelled


def test_a_decode_replica_gone_before_its_fetch_gives_the_handle_back_and_the_retry_completes():
    """The decode call never read the KV: a decode replica tells its producer to free it now
    (not at the lease's end), then the try runs once more."""
    prefill = Deployment({"prefill": [(_prefilled("r"), "handle"), (_prefilled("r-retry"), "handle-2")]})
    decode = Deployment(
        {"decode_pull": [[ReplicaUnavailableError("d0")], [_output("r-retry", 2, finished=True)]], "give_back": [None]}
    )
    assert _tokens(_run(_path(prefill=prefill, decode=decode))) == [2]
    assert [c[:2] for c in decode.calls] == [("decode_pull", "r"), ("give_back", "handle"), ("decode_pull", "r-retry")]


def test_a_pull_decode_without_output_past_the_idle_bound_gives_the_handle_back():
    prefill = Deployment({"prefill": [(_prefilled("r"), "handle")]})
    decode = Deployment({"decode_pull": [[HANG]], "give_back": [None]})
    path = _path({"limits": {"stream_idle_timeout_s": 0.05}}, prefill=prefill, decode=decode)
    with pytest.raises(HTTPError) as failed:
        _run(path)
    assert failed.value.status == 504 and decode.calls[0][2].cancelled
    assert [c[:2] for c in decode.calls] == [("decode_pull", "r"), ("give_back", "handle")]


def test_a_retry_with_no_replica_in_time_ends_with_a_503_to_retry_later():
    prefill = Deployment({"prefill": [ReplicaUnavailableError("p0")]})
    decode = Deployment({"generate": [[HANG]]})
    path = _path({"recovery": {"wait_s": 0.05}}, prefill=prefill, decode=decode)
    with pytest.raises(HTTPError) as failed:
        _run(path)
    assert failed.value.status == 503 and failed.value.headers == {"Retry-After": "5"}
    assert decode.calls[0][1] == "r-retry" and decode.calls[0][2].cancelled


def test_a_lent_replica_that_refuses_sends_the_request_disaggregated():
    prefill = Deployment({"generate": [[RoleError("now decode")]], "prefill": [(_prefilled("r"), "handle")]})
    decode = Deployment({"decode_pull": [[_output("r", 2, finished=True)]]})
    elastic = FixedRouting(Route.LENT)
    assert _tokens(_run(_path(elastic=elastic, prefill=prefill, decode=decode))) == [2]
    assert elastic.book.routed[Route.LENT] == 1 and elastic.book.routed[Route.DISAGGREGATED] == 1
    assert all(n == 0 for n in elastic.book.in_flight.values())


def test_a_client_gone_mid_stream_cancels_the_decode_call_and_ends_the_count():
    prefill = Deployment({"prefill": [(_prefilled("r"), "handle")]})
    decode = Deployment({"decode_pull": [[_output("r", 2), _output("r", 3), HANG]]})
    elastic = FixedRouting(Route.DISAGGREGATED)
    path = _path(elastic=elastic, prefill=prefill, decode=decode)
    assert _tokens(_run(path, take=1)) == [2]
    assert decode.calls[0][2].cancelled and len(decode.calls) == 1  # it read the KV: nothing to give back
    assert elastic.book.in_flight[Route.DISAGGREGATED] == 0 and not elastic.book.decoding
    assert elastic.samples == [] and path.metrics.events[-1][0] == "observe"  # the hop only: no 200


def test_a_prompt_is_queued_until_its_prefill_returns():
    elastic = FixedRouting(Route.DISAGGREGATED)
    with elastic.track(REQUEST, Route.DISAGGREGATED) as tracked:
        assert elastic.book.prefill_tokens == 4 and elastic.book.in_flight[Route.DISAGGREGATED] == 1
        tracked.prefilled(0.8)
        tracked.prefilled()
        assert elastic.book.prefill_tokens == 0 and elastic.book.seconds_per_prompt_token == pytest.approx(0.2)
    with elastic.track(REQUEST, Route.ON_DECODE):
        assert elastic.book.prompts_on_decode == 1 and elastic.book.decoding == {3: 1}
    assert elastic.book.prompts_on_decode == 0 and not elastic.book.decoding


def test_a_prompt_prefilled_on_decode_is_queued_until_its_first_output():
    decode = Deployment({"generate": [[_output("r", 2), _output("r", 3, finished=True)]]})
    elastic = FixedRouting(Route.ON_DECODE)
    path, seen = _path(elastic=elastic, decode=decode), []

    async def main() -> None:
        assert elastic.book.prompts_on_decode == 0
        async for _ in path.outputs(REQUEST):
            seen.append((elastic.book.prompts_on_decode, elastic.book.in_flight[Route.ON_DECODE]))

    asyncio.run(main())
    assert seen == [(0, 1), (0, 1)]  # in flight to its end, queued only before its first output
    assert elastic.book.in_flight[Route.ON_DECODE] == 0 and len(elastic.samples) == 1
