"""One engine request's life through the replicas, top to bottom in ``ServedRequest.outputs``:
route -> prefill -> KV hand-off -> decode stream -> retry or recover -> account.

The route: colocated (or a short prompt prefilled on decode), or the elastic routing's
(``Route``). A try on it: one replica streams the whole request, or pull (the prefill call
returns a KV handle that the decode call reads) or push (the decode call answers with a
destination first; the prefill call writes into it while the decode streams). A replica that
died, or a KV transfer that failed, before any output left here: one retry. The elastic
routing counts each try for its whole life (``ElasticRouting.track``); a try that ends
unfinished (an error, a timeout, the client gone) cancels its replica calls, so the replicas
abort the request and free its blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from app.openai_protocol import error_body
from app.settings import AppConfig
from deployments import logs
from deployments.elastic_routing import ElasticRouting, Route, Tracked
from deployments.http_errors import HTTPError, ReplicaFailure, RoleRefused, replica_call
from deployments.metrics import IngressMetrics
from engine.params import GenerationRequest, RequestOutput

logger = logs.install()


def _cached(output: RequestOutput, num_cached_tokens: int) -> RequestOutput:
    """A decode replica's output with the prompt tokens the prefill replica's cache skipped."""
    return dataclasses.replace(output, num_cached_tokens=num_cached_tokens) if num_cached_tokens else output


class _Untracked:
    """A try the elastic routing does not count (no autoscaler, or the colocated route)."""

    def prefilled(self, compute_s: float | None = None) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class RequestPath:
    """What every request goes through: the deployments' handles (``colocated`` set: the
    colocated app), the settings, the ingress's metrics and its elastic routing (None: no
    autoscaler)."""

    config: AppConfig
    metrics: IngressMetrics
    prefill: Any = None
    decode: Any = None
    colocated: Any = None
    elastic: ElasticRouting | None = None

    def outputs(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        return ServedRequest(self, request).outputs()

    def track(self, request: GenerationRequest, route: Route | None) -> AbstractContextManager[Tracked | _Untracked]:
        if self.elastic is None or route is None:
            return nullcontext(_Untracked())
        return self.elastic.track(request, route)


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One try: the request (a retry has its own id: the first try's may linger on a replica),
    its route, whether it is the retry."""

    request: GenerationRequest
    route: Route | None
    retry: bool = False


@dataclasses.dataclass
class Calls:
    """One try's replica calls; leaving it cancels what did not finish (the replicas abort
    the request and free its blocks)."""

    side: str = "decode"  # the pool the stream runs on, for recovery
    stream: Any = None  # the replica stream the outputs come from
    companion: Any = None  # the prefill call: pull, until it answers; push, watched while the decode streams
    watched: asyncio.Future | None = None
    num_cached_tokens: int = 0  # the prompt tokens the prefill replica's cache skipped
    finished: bool = False
    delivered: bool = False  # push: a token came, so the whole KV had reached the decode replica
    give_back: Any = None  # pull, until the decode stream's first output: the handle's give-back call

    async def __aenter__(self) -> Calls:
        return self

    async def __aexit__(self, *exc: object) -> None:
        watching = self.watched is not None and not self.watched.done()
        if watching:  # before its call: it ends cancelled, not with the cancelled call's error
            self.watched.cancel()
        if not self.finished:  # every cancel before the first await: a client gone may cancel that too
            if self.stream is not None:
                self.stream.cancel()
            if self.companion is not None:
                self.companion.cancel()
            if self.give_back is not None:  # the decode call may never read it: its producer frees it now
                self.give_back()
        if watching:
            await asyncio.gather(self.watched, return_exceptions=True)  # retrieved: nothing logged
        elif self.watched is not None and not self.watched.cancelled():
            self.watched.exception()  # retrieved too: a failure it had already met mattered where it was seen

    def watch(self, companion: Any) -> None:
        self.companion = companion
        self.watched = asyncio.ensure_future(replica_call(companion, "prefill"))

    async def step(self) -> RequestOutput:
        """The stream's next output; until a token came, the watched call's error first if
        that fails (its decode replica would otherwise wait for the KV until the transfer
        timeout)."""
        watched = self.watched
        if watched is None or self.delivered or watched.done() and watched.exception() is None:
            return await replica_call(self.stream.__anext__(), self.side)
        step = asyncio.ensure_future(replica_call(self.stream.__anext__(), self.side))
        try:
            await asyncio.wait({step, watched}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
            raise
        if not step.done():
            if watched.exception() is not None:
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
                raise watched.exception()
            await asyncio.wait({step})
        return step.result()

    async def prefill_figures(self) -> tuple[float | None, int]:
        """Push, once the stream ended: the watched prefill call's (compute seconds, prompt
        tokens its cache skipped). A prefill replica that died after its push completed (its
        reply lost with it) gives none: the decode replica had the whole KV, so the output
        stands."""
        watched, self.watched = self.watched, None
        try:
            result = (await watched)[0]
        except ReplicaFailure as failure:
            if not self.delivered or failure.side != "prefill":
                raise
            logger.warning("push completed, then %s: the output stands without its prefill figures", failure.reason)
            return None, 0
        return result.compute_s, result.num_cached_tokens


class ServedRequest:
    """One engine request (one choice of a body): ``outputs`` is its life; the other methods
    are its steps, in the order they run."""

    def __init__(self, path: RequestPath, request: GenerationRequest) -> None:
        self.path, self.request, self.config = path, request, path.config
        self.route: Route | None = None  # as routed; a retry's route follows from it
        self.tracked: Tracked | _Untracked = _Untracked()  # the try in progress, as counted
        self.calls = Calls()  # the try in progress's replica calls
        self.start = 0.0  # set when its outputs are first asked for (a later choice: then)
        self.first: float | None = None  # the first token's time
        self.num_tokens = 0
        self.sent = False  # an output left here: no retry
        self.prefill_s: float | None = None  # a pull's prefill call: the prefill part of TTFT
        self.asked_at = 0.0  # the loop's time the next output was asked for (the idle bound's start)
        self.retry_by: float | None = None  # the loop's time a retry's first output is due by

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come: routed, tried, retried or recovered, accounted."""
        self.start, self.asked_at = time.perf_counter(), asyncio.get_running_loop().time()
        self.route = self.choose_route()
        attempt: Attempt | None = Attempt(self.request, self.route)
        while attempt is not None:
            try:
                with self.path.track(attempt.request, attempt.route) as self.tracked:
                    async with Calls() as self.calls:
                        output = await self.bounded(self.open(attempt), attempt)
                        while output is not None:
                            yield self.count(output)
                            self.asked_at = asyncio.get_running_loop().time()
                            output = await self.bounded(self.next(), attempt)
                attempt = None
            except (RoleRefused, ReplicaFailure) as exc:
                attempt = self.next_attempt(attempt, exc)  # or raises what ends the request
        self.account()

    def choose_route(self) -> Route | None:
        """None: colocated, or a short prompt prefilled on decode (``disagg_min_prompt_tokens``)."""
        request, path = self.request, self.path
        if path.colocated is not None or len(request.prompt_token_ids) < self.config.disagg_min_prompt_tokens:
            return None
        if request.sampling.prompt_logprobs is not None:  # scored where its logits are: the whole request on decode
            return None
        if path.elastic is None:
            return Route.DISAGGREGATED
        return path.elastic.route(len(request.prompt_token_ids), request.sampling.max_tokens)

    async def open(self, attempt: Attempt) -> RequestOutput | None:
        """Start the try's replica calls by its route; its first output."""
        path, request, route = self.path, attempt.request, attempt.route
        if route is Route.DISAGGREGATED and self.config.transport.mode == "pull":
            ended = await self.prefill(request)
            if ended is not None:  # ended at its first token
                return ended
        elif route is Route.DISAGGREGATED:
            await self.push(request)
        else:  # the whole request on one replica: a lent one, or a decode (or colocated) one
            lent = route is Route.LENT
            deployment = path.prefill if lent else path.colocated or path.decode
            self.calls.side = "prefill" if lent else "decode"
            self.calls.stream = deployment.options(stream=True).generate.remote(request)
        output = await self.next()
        self.tracked.prefilled()  # the first output: its prompt is no longer queued
        return output

    async def prefill(self, request: GenerationRequest) -> RequestOutput | None:
        """Pull: prefill returns a KV handle, the decode call reads the KV with it (the
        decode replica has no logits for the first token: its log-probabilities go along).
        The request's only output when it ended at its first token."""
        path, hop_start = self.path, time.perf_counter()
        self.calls.companion = path.prefill.prefill.remote(request)  # cancelled if the try ends first
        result, handle = await replica_call(self.calls.companion, "prefill")
        self.calls.companion = None
        self.prefill_s = time.perf_counter() - hop_start
        path.metrics.prefill_hop.observe(self.prefill_s)
        self.tracked.prefilled(result.compute_s)
        if handle is None:
            return result.final_output()
        self.calls.num_cached_tokens = result.num_cached_tokens  # usage counts the prefill replica's cache
        self.calls.stream = path.decode.options(stream=True).decode_pull.remote(request, handle, result.first_logprobs)
        self.calls.give_back = lambda: path.decode.give_back.remote(handle)  # any decode replica tells the producer
        return None

    async def push(self, request: GenerationRequest) -> None:
        """Push: the decode call reserves blocks and answers with a destination first; the
        prefill call writes into it layer by layer (the first token's log-probabilities ride
        on the completion notice), watched while the decode streams."""
        self.calls.stream = self.path.decode.options(stream=True).decode_push.remote(request)
        destination = await replica_call(self.calls.stream.__anext__())
        self.calls.watch(self.path.prefill.prefill_push.remote(request, destination))

    async def next(self) -> RequestOutput | None:
        """The try's next output (None: it ended). A push's last one waits for its prefill
        call (its usage needs the prefill's figures; the prefill ends first in practice)."""
        calls = self.calls
        if calls.stream is None:  # a pull that ended at its first token
            return None
        try:
            output = await calls.step()
        except StopAsyncIteration:
            if calls.watched is not None:
                await calls.prefill_figures()
            return None
        calls.give_back = None  # the decode replica has read the KV: its notice freed the export
        calls.delivered = calls.delivered or (calls.watched is not None and bool(output.token_ids))
        calls.finished = output.finished
        if calls.finished and calls.watched is not None:
            compute_s, calls.num_cached_tokens = await calls.prefill_figures()
            self.tracked.prefilled(compute_s)
        return _cached(output, calls.num_cached_tokens)

    async def bounded(self, step: Awaitable[RequestOutput | None], attempt: Attempt) -> RequestOutput | None:
        """``step`` within the request's bounds: no output for ``limits.stream_idle_timeout_s``
        ends it with a 504 (its calls cancelled, so its blocks are freed); a retry's first
        output waits ``recovery.wait_s`` at most, then 503 with ``Retry-After``."""
        idle_by = self.asked_at + self.config.limits.stream_idle_timeout_s
        deadline = idle_by if self.retry_by is None else min(idle_by, self.retry_by)
        try:
            async with asyncio.timeout_at(deadline):  # not wait_for: a cancel that meets an output stays a cancel
                return await step
        except TimeoutError:
            raise self.timed_out(attempt, idle=deadline == idle_by) from None

    def timed_out(self, attempt: Attempt, idle: bool) -> HTTPError:
        if idle:
            idle_s = self.config.limits.stream_idle_timeout_s
            logger.warning("request %s: no output for %.0f s, aborted", self.request.request_id, idle_s)
            message = f"no output for {idle_s:g} s (limits.stream_idle_timeout_s): request aborted"
            return HTTPError(504, error_body(message, None, "server_error", "timeout"))
        message = f"no replica could take the request within {self.config.recovery.wait_s:g} s; retry later"
        logger.warning("request %s: %s", attempt.request.request_id, message)
        return HTTPError(503, error_body(message, None, "server_error"), {"Retry-After": "5"})

    def count(self, output: RequestOutput) -> RequestOutput:
        if self.first is None and output.token_ids:
            self.first = time.perf_counter()  # TTFT: the first token leaving here
        self.num_tokens += len(output.token_ids)
        self.sent, self.retry_by = True, None
        return output

    def next_attempt(self, failed: Attempt, exc: RoleRefused | ReplicaFailure) -> Attempt:
        """A lent replica reclaimed meanwhile (it refused before admitting anything): the same
        try, disaggregated. A replica failure: ``recover``."""
        if isinstance(exc, ReplicaFailure):
            return self.recover(failed, exc)
        if failed.route is not Route.LENT:  # a replica outside its role: not expected off the lent path
            raise HTTPError.busy(f"replica role changed, retry: {exc}") from None
        return dataclasses.replace(failed, route=Route.DISAGGREGATED)

    def recover(self, failed: Attempt, failure: ReplicaFailure) -> Attempt:
        """One retry when a replica died or the KV transfer failed before any output left
        here: prefilled on the decode replica when the prefill side failed, else the same
        path again (Serve picks a live replica, or the restarted one: its first output is
        awaited ``recovery.wait_s`` at most). After an output left, or when the retry failed
        too, the failure ends the request (raised: a stream gets an error event)."""
        rid = self.request.request_id
        if failed.retry:
            logger.warning("request %s: its retry failed too: %s; ended with an error", rid, failure.reason)
            raise failure
        if self.sent or not self.config.recovery.retry:
            logger.warning("request %s: %s; ended with an error", rid, failure.reason)
            raise failure
        route = Route.ON_DECODE if failure.side == "prefill" and self.route is not None else self.route
        where = "on the decode replica" if route is Route.ON_DECODE else "once more"
        logger.warning("request %s: %s; no output sent yet: retrying %s", rid, failure.reason, where)
        self.path.metrics.retries.inc(1, {"side": failure.side})
        self.retry_by = asyncio.get_running_loop().time() + self.config.recovery.wait_s
        return Attempt(dataclasses.replace(self.request, request_id=f"{rid}-retry"), route, retry=True)

    def account(self) -> None:
        """A finished request's latencies: the ingress's metrics, and the autoscaler's sample
        (TTFT, TPOT and its prefill part: a pull's prefill call; in push mode, where the
        prefill call ends with the transfer, the TTFT)."""
        end, path = time.perf_counter(), self.path
        kind = "colocated" if path.colocated is not None else "disaggregated"
        path.metrics.observe(kind, self.start, self.first, end, self.num_tokens)
        path.metrics.requests.inc(1, {"status": "200"})
        if path.elastic is None or self.first is None:
            return
        ttft_s, prefill_s = self.first - self.start, self.prefill_s
        if prefill_s is None and self.route is Route.DISAGGREGATED and self.config.transport.mode == "push":
            prefill_s = ttft_s
        tpot_s = (end - self.first) / (self.num_tokens - 1) if self.num_tokens > 1 else None
        path.elastic.observe(ttft_s, tpot_s, prefill_s)
