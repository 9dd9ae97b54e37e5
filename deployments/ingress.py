"""The OpenAI-compatible ingress (FastAPI through ``serve.ingress``).

Per request: parse and validate the body (400 naming the field), check the model (404),
let the request schema convert itself into a ``GenerationRequest`` (tokenized, checked
against the context: 400 naming the field), then send it to prefill and then to decode (or
to a colocated replica) and stream the tokens back. Backpressure: at most
``max_queued_requests`` requests in flight per ingress replica; beyond that 503 with
``Retry-After``. A client that goes away cancels the replica calls, which abort the request
and free its blocks on every replica. Errors from replicas are mapped by type (``_http_error``).
"""

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve

from app.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    unsupported,
    validation_error_body,
)
from app.settings import AppConfig
from deployments.elastic_routing import ElasticRouting, Route
from deployments.metrics import IngressMetrics
from deployments.openai_format import (
    CHAT,
    COMPLETION,
    ChunkWriter,
    ResponseFormat,
    full_response_choices,
    sse,
    token_text_of,
)
from engine.core import RoleError
from engine.loader import ModelSpec, load_tokenizer, model_name
from engine.params import ContextLimits, FieldError, GenerationRequest, RequestOutput
from kv_transport.base import KVTransferError
from kv_transport.engine_link import KVCapacityError

logger = logging.getLogger(__name__)
api = FastAPI(title="tandem", docs_url=None, redoc_url=None)


def choice_requests(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The engine requests of one body's ``n`` choices: ids ``<id>-<i>``; with a ``seed``,
    choice i samples with seed + i (distinct choices, reproducible with the same seed)."""
    if n == 1:
        return [request]
    choices = []
    for i in range(n):
        sampling = request.sampling
        if sampling.seed is not None:
            seed = sampling.seed + i
            sampling = dataclasses.replace(sampling, seed=seed - 2**64 if seed >= 2**64 else seed)
        choices.append(dataclasses.replace(request, request_id=f"{request.request_id}-{i}", sampling=sampling))
    return choices


async def merge_after_first(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Items of ``streams`` as they come, as (stream index, item); stream 0 alone until its
    first item. An error in one stream ends all of them (each closed on the way out)."""
    pending: dict[asyncio.Future, int] = {}

    def advance(i: int) -> None:
        pending[asyncio.ensure_future(anext(streams[i]))] = i

    advance(0)
    waiting = list(range(1, len(streams)))
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    item = None
                else:
                    advance(i)
                for j in waiting:
                    advance(j)
                waiting = []
                if item is not None:
                    yield i, item
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def _cached(output: RequestOutput, num_cached_tokens: int) -> RequestOutput:
    """A decode replica's output with the prompt tokens the prefill replica's cache skipped."""
    return dataclasses.replace(output, num_cached_tokens=num_cached_tokens) if num_cached_tokens else output


class RoleRefused(Exception):
    """The replica the router chose had just changed role and refused the admission (nothing
    was admitted there): the request takes another path."""


class HTTPError(Exception):
    def __init__(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        super().__init__(body["error"]["message"])
        self.status, self.body, self.headers = status, body, headers or {}

    @classmethod
    def bad_request(cls, exc: FieldError) -> "HTTPError":
        return cls(400, error_body(exc.message, exc.param))

    @classmethod
    def busy(cls, message: str) -> "HTTPError":
        return cls(503, error_body(message, None, "server_error"), {"Retry-After": "1"})

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


def _http_error(cause: BaseException) -> HTTPError:
    """What a replica call raised (``RayTaskError.cause``), as the client's error: by type."""
    if isinstance(cause, KVCapacityError):
        return HTTPError.busy("no KV capacity on the decode pool, retry later")
    if isinstance(cause, FieldError):  # the engine refused the request's input
        return HTTPError.bad_request(cause)
    if isinstance(cause, ValueError):  # e.g. a request id already on that engine
        return HTTPError(400, error_body(str(cause), None))
    name = type(cause).__name__
    if isinstance(cause, KVTransferError):
        logger.warning("KV transfer failed: %s", cause)
    else:
        logger.error("request failed", exc_info=cause)
    return HTTPError(500, error_body(f"internal error ({name})", None, "server_error"))


@serve.ingress(api)
class OpenAIIngress:
    def __init__(
        self,
        config: dict[str, Any],
        prefill: Any = None,
        decode: Any = None,
        colocated: Any = None,
        controller: Any = None,
    ):
        self.config = AppConfig.model_validate(config)
        spec = ModelSpec(source=self.config.model.source)
        self.tokenizer = load_tokenizer(spec)
        self._text_of = token_text_of(self.tokenizer)
        self.model = self.config.model.served_name or model_name(spec)
        self.max_model_len = self.config.model.max_model_len
        vocab_size = len(self.tokenizer) if self.tokenizer is not None else None
        self.limits = ContextLimits(max_model_len=self.max_model_len, vocab_size=vocab_size)
        self.prefill, self.decode, self.colocated = prefill, decode, colocated
        self.in_flight = 0
        self._active_ids: set[str] = set()
        self.metrics = IngressMetrics()
        self.elastic = None
        if controller is not None:
            slo = self.config.slo
            self.elastic = ElasticRouting(controller, self.config.autoscaling.load(slo.ttft_ms, slo.tpot_ms))

    # ---- endpoints ----------------------------------------------------------------------

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/ready")
    async def ready(self) -> dict:
        if self.colocated is not None:
            mode = "colocated"
        else:
            mode = f"disaggregated-{self.config.transport.mode}"
        return {"status": "ready", "model": self.model, "mode": mode, "in_flight": self.in_flight}

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {
            "object": "list",
            "data": [{"id": self.model, "object": "model", "owned_by": "tandem", "max_model_len": self.max_model_len}],
        }

    @api.get("/admin/autoscaler", response_model=None)
    async def autoscaler(self) -> dict | JSONResponse:
        """The policy, each engine replica's role and load, the last decisions with reasons."""
        if self.elastic is None:
            return {"enabled": False, "policy": None, "replicas": [], "decisions": []}
        try:
            return await self.elastic.view()
        except Exception as exc:  # the controller restarting or wedged
            return HTTPError.busy(f"the autoscaler's controller did not answer: {type(exc).__name__}").response()

    @api.post("/v1/chat/completions")
    async def chat(self, raw: Request):
        return await self._serve(raw, ChatCompletionRequest, CHAT)

    @api.post("/v1/completions")
    async def completions(self, raw: Request):
        return await self._serve(raw, CompletionRequest, COMPLETION)

    # ---- one request --------------------------------------------------------------------

    async def _serve(self, raw: Request, schema: type, fmt: ResponseFormat):
        try:
            body = self._check_body(schema, await self._read_json(raw))
            request = self._to_engine(body, raw.headers.get("x-request-id"))
            self._admit(request)
        except HTTPError as exc:  # refused before any replica saw it: counted too
            self.metrics.requests.inc(1, {"status": str(exc.status)})
            return exc.response()
        headers = {"X-Request-Id": request.request_id}
        text_of = self._text_of if request.sampling.logprobs is not None else None
        choices = choice_requests(request, body.n)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = self._stream(fmt, request.request_id, choices, include_usage, text_of)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        self.in_flight += 1
        outputs: list[list[RequestOutput]] = [[] for _ in choices]
        try:
            async for index, output in self._choice_outputs(request.request_id, choices):
                outputs[index].append(output)
        except HTTPError as exc:
            self.metrics.requests.inc(1, {"status": str(exc.status)})
            return exc.response()
        finally:
            self.in_flight -= 1
        body = full_response_choices(fmt, request.request_id, self.model, outputs, text_of)
        return JSONResponse(body, headers=headers)

    @staticmethod
    async def _read_json(raw: Request) -> dict:
        try:
            data = json.loads(await raw.body())
        # JSONDecodeError and UnicodeDecodeError are ValueErrors, as is an integer of over
        # 4,300 digits; very deep nesting is a RecursionError
        except (ValueError, RecursionError) as exc:
            raise HTTPError(400, error_body(f"malformed JSON body: {exc}", None)) from None
        if not isinstance(data, dict):
            raise HTTPError(400, error_body("the body must be a JSON object", None))
        return data

    def _check_body(self, schema: type, data: dict):
        """The body validated by its schema, for this model, with no unimplemented field set."""
        try:
            body = schema.model_validate(data)
        except ValidationError as exc:
            raise HTTPError(400, validation_error_body(exc)) from None
        if body.model != self.model:
            message = f"The model `{body.model}` does not exist."
            raise HTTPError(404, error_body(message, "model", "invalid_request_error", "model_not_found"))
        problem = unsupported(body)
        if problem is not None:
            raise HTTPError(400, error_body(problem[1], problem[0]))
        return body

    def _to_engine(self, body: Any, client_id: str | None) -> GenerationRequest:
        try:
            return body.to_generation_request(self.tokenizer, self.limits, client_id)
        except FieldError as exc:
            raise HTTPError.bad_request(exc) from None

    def _admit(self, request: GenerationRequest) -> None:
        """Refuse a request id already in flight here, and any request beyond the queue bound."""
        if request.request_id in self._active_ids:
            message = f"X-Request-Id: request id {request.request_id!r} is already in flight"
            raise HTTPError(400, error_body(message, "X-Request-Id"))
        if self.in_flight >= self.config.max_queued_requests:
            raise HTTPError.busy("server busy: too many requests in flight")
        self._active_ids.add(request.request_id)  # discarded when _timed ends

    async def _stream(
        self, fmt: ResponseFormat, request_id: str, choices: list[GenerationRequest], include_usage: bool, text_of: Any
    ) -> AsyncIterator[bytes]:
        writers = [ChunkWriter(fmt, request_id, self.model, text_of, index) for index in range(len(choices))]
        self.in_flight += 1
        try:
            for writer in writers:
                first = writer.start()
                if first:
                    yield first
            last: dict[int, RequestOutput] = {}
            async for index, output in self._choice_outputs(request_id, choices):
                last[index] = output
                chunk = writers[index].delta(output)
                if chunk:
                    yield chunk
            if include_usage and len(last) == len(choices):
                yield writers[0].usage(*(last[i] for i in range(len(choices))))
        except HTTPError as exc:
            self.metrics.requests.inc(1, {"status": str(exc.status)})
            yield sse(exc.body)
        finally:
            self.in_flight -= 1
        yield writers[0].done()

    async def _choice_outputs(
        self, request_id: str, choices: list[GenerationRequest]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The choices' outputs as they come, with the choice's index. With ``n`` > 1, choice 0
        runs alone until its first output: its prompt's KV is then in the prefix caches (the
        prefill replica's, and the decode replica's that fetched it), and the router sends the
        other choices where that prefix went, so the prompt is computed and moved once."""
        try:
            if len(choices) == 1:
                async for output in self._timed(choices[0]):
                    yield 0, output
                return
            async with aclosing(merge_after_first([self._timed(c) for c in choices])) as merged:
                async for index, output in merged:
                    yield index, output
        finally:
            self._active_ids.discard(request_id)

    async def _timed(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """``_outputs`` with TTFT / TPOT / E2E recorded (TTFT: the first token leaving here)."""
        start, first, num_tokens = time.perf_counter(), None, 0
        route = self._route(request)
        try:
            async for output in self._outputs(request, route):
                if first is None and output.token_ids:
                    first = time.perf_counter()
                num_tokens += len(output.token_ids)
                yield output
        finally:
            self._active_ids.discard(request.request_id)
            prefill_s = self.elastic.pop_prefill_s(request.request_id) if self.elastic is not None else None
        end = time.perf_counter()
        path = "colocated" if self.colocated is not None else "disaggregated"
        self.metrics.observe(path, start, first, end, num_tokens)
        self.metrics.requests.inc(1, {"status": "200"})
        if self.elastic is not None and first is not None:
            self._observe(route, prefill_s, first - start, end - first, num_tokens)

    # ---- the paths through the replicas ---------------------------------------------------

    def _observe(
        self, route: Route | None, prefill_s: float | None, ttft_s: float, decode_s: float, num_tokens: int
    ) -> None:
        """Hand a finished request's latencies to the autoscaler: TTFT, TPOT and its prefill
        part (a pull's prefill call; in push mode, where the prefill call ends with the
        transfer, the TTFT)."""
        if prefill_s is None and route is Route.DISAGGREGATED and self.config.transport.mode == "push":
            prefill_s = ttft_s
        self.elastic.observe(ttft_s, decode_s / (num_tokens - 1) if num_tokens > 1 else None, prefill_s)

    def _route(self, request: GenerationRequest) -> Route | None:
        """None: colocated, or a short prompt prefilled on decode (``disagg_min_prompt_tokens``)."""
        if self.colocated is not None or len(request.prompt_token_ids) < self.config.disagg_min_prompt_tokens:
            return None
        if self.elastic is None:
            return Route.DISAGGREGATED
        return self.elastic.route(len(request.prompt_token_ids), request.sampling.max_tokens)

    async def _outputs(self, request: GenerationRequest, route: Route | None) -> AsyncIterator[RequestOutput]:
        """Route one request: colocated, prefilled on decode, on a lent replica, pull or push."""
        if route is Route.LENT:
            try:
                async with aclosing(self._tracked(route, request)) as outputs:
                    async for output in outputs:
                        yield output
                return
            except RoleRefused:  # reclaimed meanwhile, before admitting anything there
                route = Route.DISAGGREGATED
        try:
            async with aclosing(self._tracked(route, request)) as outputs:
                async for output in outputs:
                    yield output
        except RoleRefused as exc:  # a replica outside its role: not expected off the lent path
            raise HTTPError.busy(f"replica role changed, retry: {exc}") from None

    def _path(self, route: Route | None, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if route is None:
            return self._generate(self.colocated or self.decode, request)
        if route is Route.LENT:
            return self._generate(self.prefill, request)
        if route is Route.ON_DECODE:
            return self._generate(self.decode, request)
        return self._pull(request) if self.config.transport.mode == "pull" else self._push(request)

    async def _tracked(self, route: Route | None, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """The route's path; counted in flight on its route, its prompt until the first token."""
        async with aclosing(self._path(route, request)) as outputs:
            if self.elastic is None or route is None:
                async for output in outputs:
                    yield output
                return
            with self.elastic.in_flight(route, request.sampling.max_tokens):
                with self.elastic.prompt_pending(request.request_id, route, len(request.prompt_token_ids)):
                    output = await anext(outputs, None)
                if output is None:
                    return
                yield output
                async for output in outputs:
                    yield output

    async def _generate(self, deployment: Any, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """The whole request on one replica."""
        async for output in self._relay(deployment.options(stream=True).generate.remote(request)):
            yield output

    async def _pull(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Prefill returns a handle; decode reads the KV with it, then streams."""
        hop_start = time.perf_counter()
        result, handle = await self._call(self.prefill.prefill.remote(request))
        self.metrics.prefill_hop.observe(time.perf_counter() - hop_start)
        if self.elastic is not None:
            hop_s = time.perf_counter() - hop_start
            self.elastic.prefill_returned(request.request_id, hop_s, len(request.prompt_token_ids), result.compute_s)
        if handle is None:  # ended at its first token
            yield result.final_output()
            return
        # the decode replica has no logits for the first token: its log-probabilities go along
        stream = self.decode.options(stream=True).decode_pull.remote(request, handle, result.first_logprobs)
        async for output in self._relay(stream):
            yield _cached(output, result.num_cached_tokens)  # usage counts the prefill replica's cache

    async def _push(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Decode reserves blocks and answers with a destination first; prefill writes into it
        layer by layer (the first token's log-probabilities ride on the completion notice)."""
        stream = self.decode.options(stream=True).decode_push.remote(request)
        try:
            destination = await self._call(stream.__anext__())
        except BaseException:
            stream.cancel()
            raise
        prefill_call = self.prefill.prefill_push.remote(request, destination)
        async for output in self._relay(stream, prefill_call, self._push_done(request)):
            yield output

    def _push_done(self, request: GenerationRequest) -> Any:
        def done(result: Any, last: RequestOutput) -> RequestOutput:
            if self.elastic is not None:
                self.elastic.prefill_speed(len(request.prompt_token_ids), result[0].compute_s)
            return _cached(last, result[0].num_cached_tokens)

        return done

    async def _relay(
        self, stream: Any, companion: Any = None, on_companion: Any = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield a replica stream's outputs; with a ``companion`` (the push's prefill call), the
        last one waits for it and goes through ``on_companion(result, last)`` (its usage needs
        the prefill's figures; the prefill ends before the decode in practice).
        Unfinished (client gone, an error): cancelling both aborts the request on the replicas."""
        finished = False
        try:
            async for output in self._iterate(stream):
                finished = output.finished
                if finished and companion is not None:
                    result = await self._call(companion)
                    companion = None
                    output = on_companion(result, output) if on_companion is not None else output
                yield output
            if companion is not None:
                await self._call(companion)
        finally:
            if not finished:
                stream.cancel()
                if companion is not None:
                    companion.cancel()

    async def _iterate(self, stream: Any) -> AsyncIterator[RequestOutput]:
        while True:
            try:
                output = await self._call(stream.__anext__())
            except StopAsyncIteration:
                return
            yield output

    @staticmethod
    async def _call(awaitable: Any) -> Any:
        """Await a replica call; map what it raises to an HTTP error (never a stack trace)."""
        try:
            return await awaitable
        except (StopAsyncIteration, asyncio.CancelledError):
            raise
        except Exception as exc:
            cause = getattr(exc, "cause", exc)
            if isinstance(cause, RoleError):
                raise RoleRefused(str(cause)) from None
            raise _http_error(cause) from None
