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
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import RequestCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from app.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    unsupported,
    validation_error_body,
)
from app.settings import AppConfig
from deployments import logs
from deployments.auth import KEY_ID, APIKeyMiddleware, ApiKeys
from deployments.elastic_routing import ElasticRouting, Route
from deployments.limits import BodyTooLarge, HeldStreamingResponse, KeySlots, Slot, read_body
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
from deployments.openapi import ServedAPI, error_responses
from engine.core import RoleError
from engine.loader import ModelSpec, load_tokenizer, model_name
from engine.params import ContextLimits, FieldError, GenerationRequest, RequestOutput
from kv_transport.base import KVTransferError
from kv_transport.engine_link import KVCapacityError

logger = logs.install()  # Serve's logger: lines land in the replica's log file, with the request id
api = ServedAPI(title="tandem", docs_url=None, redoc_url=None)


def _replica_keys() -> ApiKeys | None:
    """The serving replica's API keys (None: auth off), for what runs outside its handlers."""
    return serve.get_replica_context().servable_object.api_keys


def _auth_on() -> bool:
    return _replica_keys() is not None


api.add_middleware(APIKeyMiddleware, keys_of=_replica_keys)
api.auth_on = _auth_on


@api.exception_handler(StarletteHTTPException)
async def _routing_error(raw: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Routing's own refusals (no such path: 404, wrong method: 405) as OpenAI-style bodies."""
    body = error_body(f"{exc.detail} ({raw.method} {raw.url.path})", None)
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


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


class ReplicaFailure(HTTPError):
    """A replica died, or the KV transfer failed, on one ``side`` of a request (``prefill``:
    the prefill call or the transfer; ``decode``: the replica that streams the tokens). Before
    any token reached the client the ingress retries the request once (``_recovering``);
    after, the client gets this error."""

    def __init__(self, side: str, reason: str, body: dict) -> None:
        super().__init__(503, body, {"Retry-After": "1"})
        self.side, self.reason = side, reason


def _replica_died(exc: BaseException) -> bool:
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    return isinstance(exc, RayActorError | ReplicaUnavailableError | DeploymentUnavailableError)


def _http_error(exc: BaseException, side: str = "decode") -> HTTPError:
    """What a replica call raised (``RayTaskError.cause`` when the replica raised it), as the
    client's error: by type. A dead replica and a failed transfer are ``ReplicaFailure``s
    (expected events: one log line, no traceback, by ``_recovering``)."""
    cause = getattr(exc, "cause", None) or exc
    if isinstance(cause, KVCapacityError):
        return HTTPError.busy("no KV capacity on the decode pool, retry later")
    if isinstance(cause, FieldError):  # the engine refused the request's input
        return HTTPError.bad_request(cause)
    if isinstance(cause, ValueError):  # e.g. a request id already on that engine
        return HTTPError(400, error_body(str(cause), None))
    name = type(cause).__name__
    if isinstance(cause, KVTransferError):
        message = f"KV transfer failed ({name}): {cause.message}"
        return ReplicaFailure("prefill", message, error_body(message, None, "server_error", "kv_transfer_failed"))
    if _replica_died(exc) or _replica_died(cause):
        message = f"the {side} replica serving this request is gone ({name})"
        return ReplicaFailure(side, message, error_body(message, None, "server_error", "replica_unavailable"))
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
        limits = self.config.limits
        self.limits = ContextLimits(
            max_model_len=self.max_model_len,
            vocab_size=vocab_size,
            max_prompt_tokens=limits.max_prompt_tokens,
            max_tokens=limits.max_tokens,
        )
        self.prefill, self.decode, self.colocated = prefill, decode, colocated
        self.in_flight = 0
        self._active_ids: set[str] = set()
        self.metrics = IngressMetrics()
        self.api_keys, self.key_slots = self._auth(), KeySlots(limits.max_concurrent_per_key)
        self._app_name = serve.get_replica_context().app_name
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

    @api.get("/v1/models", responses=error_responses(401))
    async def models(self) -> dict:
        return {
            "object": "list",
            "data": [{"id": self.model, "object": "model", "owned_by": "tandem", "max_model_len": self.max_model_len}],
        }

    @api.get("/admin/autoscaler", response_model=None, responses=error_responses(401, 503))
    async def autoscaler(self) -> dict | JSONResponse:
        """The policy, each engine replica's role and load, the last decisions with reasons."""
        if self.elastic is None:
            return {"enabled": False, "policy": None, "replicas": [], "decisions": []}
        try:
            return await self.elastic.view()
        except Exception as exc:  # the controller restarting or wedged
            return HTTPError.busy(f"the autoscaler's controller did not answer: {type(exc).__name__}").response()

    @api.get("/admin/kv", response_model=None, responses=error_responses(401, 503))
    async def kv(self) -> dict | JSONResponse:
        """Each engine replica's KV accounting with its invariants checked (free + cached + in
        use == total; every block in use held by a live request), as published about once a
        second (``deployments/kv_state.py``): totals, pinned, reserved, the oldest pinned
        export's age; ``live`` false for a replica that stopped publishing (dead or wedged)."""
        from deployments import kv_state

        try:
            entries = await asyncio.to_thread(kv_state.read_all, self._app_name)
        except Exception as exc:  # the GCS briefly away
            return HTTPError.busy(f"KV state unavailable: {type(exc).__name__}").response()
        return kv_state.summary(entries)

    @api.post(
        "/v1/chat/completions",
        openapi_extra=api.json_body(ChatCompletionRequest),
        responses=error_responses(400, 401, 404, 413, 429, 503, 504),
    )
    async def chat(self, raw: Request):
        return await self._serve(raw, ChatCompletionRequest, CHAT)

    @api.post(
        "/v1/completions",
        openapi_extra=api.json_body(CompletionRequest),
        responses=error_responses(400, 401, 404, 413, 429, 503, 504),
    )
    async def completions(self, raw: Request):
        return await self._serve(raw, CompletionRequest, COMPLETION)

    def _auth(self) -> ApiKeys | None:
        """The API keys (read now, from ``auth``), None when auth is off."""
        auth, limit = self.config.auth, self.config.limits.max_concurrent_per_key
        if not auth.enabled:
            if limit is not None:
                logger.warning("limits.max_concurrent_per_key=%d has no effect without auth (API keys)", limit)
            return None
        return ApiKeys(auth.keys(), on_refused=lambda: self.metrics.requests.inc(1, {"status": "401"}))

    # ---- one request --------------------------------------------------------------------

    async def _serve(self, raw: Request, schema: type, fmt: ResponseFormat):
        """One generation request, holding its API key's slot (``limits.max_concurrent_per_key``)
        for its whole life: until its answer, or the last of its stream, has been sent."""
        slot = self.key_slots.take(getattr(raw.state, KEY_ID, None))
        if slot is None:
            self.metrics.requests.inc(1, {"status": "429"})
            message = f"this API key has {self.key_slots.limit} requests in flight (limits.max_concurrent_per_key)"
            body = error_body(message, None, "requests", "rate_limit_exceeded")
            return HTTPError(429, body, {"Retry-After": "1"}).response()
        held = False
        try:
            response = await self._respond(raw, schema, fmt, slot)
            held = isinstance(response, HeldStreamingResponse)  # it releases the slot when sent
            return response
        finally:
            if not held:
                slot.release()

    async def _respond(self, raw: Request, schema: type, fmt: ResponseFormat, slot: Slot):
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
            # the request id is free again when the stream ends, even one that never started
            done = lambda: self._active_ids.discard(request.request_id)  # noqa: E731
            return HeldStreamingResponse(
                stream, media_type="text/event-stream", headers=headers, slot=slot, on_end=done
            )
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

    async def _read_json(self, raw: Request) -> dict:
        try:
            data = json.loads(await read_body(raw, self.config.limits.max_body_bytes))
        except BodyTooLarge as exc:
            raise HTTPError(413, error_body(str(exc), None, "invalid_request_error", "request_too_large")) from None
        except ClientDisconnect:  # the answer goes nowhere; ends the request without a traceback
            raise HTTPError(400, error_body("the client went away while sending the body", None)) from None
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
        """``_recovering`` with TTFT / TPOT / E2E recorded (TTFT: the first token leaving here),
        and the idle bound: no output for ``limits.stream_idle_timeout_s`` ends the request
        (its replica calls cancelled, so its blocks are freed) with a 504."""
        start, first, num_tokens = time.perf_counter(), None, 0
        route = self._route(request)
        idle_s = self.config.limits.stream_idle_timeout_s
        try:
            async with aclosing(self._recovering(request, route)) as outputs:
                while True:
                    try:
                        output = await asyncio.wait_for(anext(outputs), idle_s)
                    except StopAsyncIteration:
                        break
                    except TimeoutError:
                        logger.warning("request %s: no output for %.0f s, aborted", request.request_id, idle_s)
                        message = f"no output for {idle_s:g} s (limits.stream_idle_timeout_s): request aborted"
                        raise HTTPError(504, error_body(message, None, "server_error", "timeout")) from None
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

    async def _recovering(self, request: GenerationRequest, route: Route | None) -> AsyncIterator[RequestOutput]:
        """``_outputs``, retried once when a replica died or the KV transfer failed before any
        output left here: prefilled on the decode replica when the prefill side failed, else
        the same path again (Serve picks a live replica, or the restarted one: its first output
        is awaited ``recovery.wait_s`` at most, then 503 with ``Retry-After``). After an output
        left, the failure ends the request (a stream gets an error event)."""
        rid, sent = request.request_id, False
        try:
            async with aclosing(self._outputs(request, route)) as outputs:
                async for output in outputs:
                    sent = True
                    yield output
            return
        except ReplicaFailure as exc:
            if sent or not self.config.recovery.retry:
                logger.warning("request %s: %s; ended with an error", rid, exc.reason)
                raise
            failure = exc
        retry = Route.ON_DECODE if failure.side == "prefill" and route is not None else route
        where = "on the decode replica" if retry is Route.ON_DECODE else "once more"
        logger.warning("request %s: %s; no output sent yet: retrying %s", rid, failure.reason, where)
        self.metrics.retries.inc(1, {"side": failure.side})
        again = dataclasses.replace(request, request_id=f"{rid}-retry")  # the first try's id may linger there
        try:
            async with aclosing(self._retried(again, retry)) as outputs:
                async for output in outputs:
                    yield output
        except ReplicaFailure as exc:
            logger.warning("request %s: its retry failed too: %s; ended with an error", rid, exc.reason)
            raise

    async def _retried(self, request: GenerationRequest, route: Route | None) -> AsyncIterator[RequestOutput]:
        """``_outputs`` with its first output awaited ``recovery.wait_s`` at most (503 beyond)."""
        async with aclosing(self._outputs(request, route)) as outputs:
            try:
                output = await asyncio.wait_for(anext(outputs), self.config.recovery.wait_s)
            except StopAsyncIteration:
                return
            except TimeoutError:
                message = f"no replica could take the request within {self.config.recovery.wait_s:g} s; retry later"
                logger.warning("request %s: %s", request.request_id, message)
                raise HTTPError(503, error_body(message, None, "server_error"), {"Retry-After": "5"}) from None
            yield output
            async for output in outputs:
                yield output

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
            return self._generate(self.colocated or self.decode, request, "decode")
        if route is Route.LENT:
            return self._generate(self.prefill, request, "prefill")
        if route is Route.ON_DECODE:
            return self._generate(self.decode, request, "decode")
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

    async def _generate(self, deployment: Any, request: GenerationRequest, side: str) -> AsyncIterator[RequestOutput]:
        """The whole request on one replica (``side``: the pool it belongs to, for recovery)."""
        async for output in self._relay(deployment.options(stream=True).generate.remote(request), side):
            yield output

    async def _pull(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Prefill returns a handle; decode reads the KV with it, then streams."""
        hop_start = time.perf_counter()
        result, handle = await self._call(self.prefill.prefill.remote(request), "prefill")
        self.metrics.prefill_hop.observe(time.perf_counter() - hop_start)
        if self.elastic is not None:
            hop_s = time.perf_counter() - hop_start
            self.elastic.prefill_returned(request.request_id, hop_s, len(request.prompt_token_ids), result.compute_s)
        if handle is None:  # ended at its first token
            yield result.final_output()
            return
        # the decode replica has no logits for the first token: its log-probabilities go along
        stream = self.decode.options(stream=True).decode_pull.remote(request, handle, result.first_logprobs)
        async for output in self._relay(stream, "decode"):
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
        async for output in self._relay(stream, "decode", prefill_call, self._push_done(request)):
            yield output

    def _push_done(self, request: GenerationRequest) -> Any:
        def done(result: Any, last: RequestOutput) -> RequestOutput:
            if self.elastic is not None:
                self.elastic.prefill_speed(len(request.prompt_token_ids), result[0].compute_s)
            return _cached(last, result[0].num_cached_tokens)

        return done

    async def _relay(
        self, stream: Any, side: str, companion: Any = None, on_companion: Any = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield a replica stream's outputs; with a ``companion`` (the push's prefill call), the
        last one waits for it and goes through ``on_companion(result, last)`` (its usage needs
        the prefill's figures; the prefill ends before the decode in practice). The companion
        is watched meanwhile: if its replica dies or its push fails, the stream is given up at
        once (its decode replica would wait for the KV until the transfer timeout).
        Unfinished (client gone, an error): cancelling both aborts the request on the replicas."""
        finished = False
        watched = asyncio.ensure_future(self._call(companion, "prefill")) if companion is not None else None
        try:
            while True:
                try:
                    output = await self._next(stream, side, watched)
                except StopAsyncIteration:
                    break
                finished = output.finished
                if finished and watched is not None:
                    result, watched = await watched, None
                    output = on_companion(result, output) if on_companion is not None else output
                yield output
            if watched is not None:
                await watched
        finally:
            if watched is not None and not watched.done():  # first: its call is cancelled next
                watched.cancel()
                await asyncio.gather(watched, return_exceptions=True)  # retrieved: nothing logged
            if not finished:
                stream.cancel()
                if companion is not None:
                    companion.cancel()

    async def _next(self, stream: Any, side: str, watched: asyncio.Future | None) -> RequestOutput:
        """The stream's next output; raises the watched call's error first if that fails."""
        if watched is None or watched.done() and watched.exception() is None:
            return await self._call(stream.__anext__(), side)
        step = asyncio.ensure_future(self._call(stream.__anext__(), side))
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

    @staticmethod
    async def _call(awaitable: Any, side: str = "decode") -> Any:
        """Await a replica call on ``side`` (prefill or decode); map what it raises to an HTTP
        error (never a stack trace)."""
        try:
            return await awaitable
        except (StopAsyncIteration, asyncio.CancelledError):
            raise
        except RequestCancelledError:  # this ingress cancelled the call (client gone, request ended)
            raise asyncio.CancelledError() from None
        except Exception as exc:
            cause = getattr(exc, "cause", exc)
            if isinstance(cause, RoleError):
                raise RoleRefused(str(cause)) from None
            raise _http_error(exc, side) from None
