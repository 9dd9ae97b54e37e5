"""The OpenAI-compatible ingress (FastAPI through ``serve.ingress``).

Per request: parse and validate the body (400 naming the field), check the model (404),
let the request schema convert itself into a ``GenerationRequest`` (tokenized, checked
against the context: 400 naming the field), admit it, then answer with its choices' outputs
(``deployments.request_path``: routed, prefilled, decoded, retried, accounted), streamed as
server-sent events or as one body. Backpressure: at most ``max_queued_requests`` requests in
flight per ingress replica; beyond that 503 with ``Retry-After``. A client that goes away
ends the outputs, which cancels the replica calls (the request's blocks are freed on every
replica).
"""

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from app.openai_protocol import (
    ChatCompletionRequest,
    ChatSetup,
    CompletionRequest,
    error_body,
    lone_surrogate,
    unsupported,
    validation_error_body,
)
from app.responses_protocol import ResponsesRequest
from app.settings import AppConfig
from app.tokenize_protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, tokenize_schema
from deployments import logs
from deployments.auth import KEY_ID, APIKeyMiddleware, ApiKeys
from deployments.elastic_routing import ElasticRouting
from deployments.http_errors import HTTPError
from deployments.limits import BodyTooLarge, HeldStreamingResponse, KeySlots, Slot, read_body
from deployments.metrics import IngressMetrics
from deployments.openai_format import (
    CHAT,
    COMPLETION,
    ChunkWriter,
    Echo,
    PromptLogprobs,
    ResponseFormat,
    token_text_of,
)
from deployments.openapi import ServedAPI, error_responses
from deployments.request_path import RequestPath
from deployments.responses_format import ResponseEvents, ResponsesFormat
from engine.loader import ModelSpec, load_tokenizer, model_name
from engine.params import ContextLimits, FieldError, GenerationRequest, RequestOutput, unique_request_id

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


async def merge_after_first(streams: list[AsyncIterator[Any]], group: int = 0) -> AsyncIterator[tuple[int, Any]]:
    """Items of ``streams`` as they come, as (stream index, item). Of each ``group`` streams in
    turn (0: all of them) the first runs alone until its first item. An error in one stream
    ends all of them (each closed on the way out)."""
    pending: dict[asyncio.Future, int] = {}

    def advance(i: int) -> None:
        pending[asyncio.ensure_future(anext(streams[i]))] = i

    size = group or len(streams)
    waiting = {first: range(first + 1, min(first + size, len(streams))) for first in range(0, len(streams), size)}
    for first in waiting:
        advance(first)
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
                for j in waiting.pop(i, ()):
                    advance(j)
                if item is not None:
                    yield i, item
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


@serve.ingress(api)
class OpenAIIngress:
    def __init__(
        self,
        config: AppConfig,
        prefill: Any = None,
        decode: Any = None,
        colocated: Any = None,
        controller: Any = None,
    ):
        """``config``: the application's settings, validated once by the builder; ``prefill`` and
        ``decode`` (disagg_app) or ``colocated`` (colocated_app): the engine pools' handles;
        ``controller``: the autoscaler's handle when autoscaling is on."""
        self.config = config
        spec = ModelSpec(source=self.config.model.source)
        self.tokenizer = load_tokenizer(spec)
        self._text_of = token_text_of(self.tokenizer)
        self.responses_format = ResponsesFormat(self._count_tokens)
        self.model = self.config.model.served_name or model_name(spec)
        own, api_settings = getattr(self.tokenizer, "chat_template", None), self.config.api
        self.chat = ChatSetup.of(
            own, api_settings.template_text, api_settings.tool_call_parser, api_settings.reasoning_parser
        )
        self.max_model_len = self.config.model.max_model_len
        self.created = int(time.time())  # /v1/models' "created": when this ingress started serving it
        vocab_size = len(self.tokenizer) if self.tokenizer is not None else None
        limits = self.config.limits
        self.limits = ContextLimits(
            max_model_len=self.max_model_len,
            vocab_size=vocab_size,
            max_prompt_tokens=limits.max_prompt_tokens,
            max_tokens=limits.max_tokens,
        )
        self.in_flight = 0
        self.metrics = IngressMetrics()
        self.api_keys, self.key_slots = self._auth(), KeySlots(limits.max_concurrent_per_key)
        self._app_name = serve.get_replica_context().app_name
        self.elastic = None
        if controller is not None:
            slo = self.config.slo
            self.elastic = ElasticRouting(controller, self.config.autoscaling.load(slo.ttft_ms, slo.tpot_ms))
        self.path = RequestPath(self.config, self.metrics, prefill, decode, colocated, self.elastic)

    # ---- endpoints ----------------------------------------------------------------------

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/ready")
    async def ready(self) -> dict:
        if self.path.colocated is not None:
            mode = "colocated"
        else:
            mode = f"disaggregated-{self.config.transport.mode}"
        return {"status": "ready", "model": self.model, "mode": mode, "in_flight": self.in_flight}

    @api.get("/v1/models", responses=error_responses(401))
    async def models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    @api.get("/v1/models/{model:path}", response_model=None, responses=error_responses(401, 404))
    async def model_card(self, model: str) -> dict | JSONResponse:
        """One model (OpenAI's retrieve): this server's, or 404 naming ``model``."""
        if model != self.model:
            return self._unknown_model(model).response()
        return self._model_card()

    def _model_card(self) -> dict:
        return {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "tandem",
            "max_model_len": self.max_model_len,
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

    @api.post(
        "/v1/responses",
        openapi_extra=api.json_body(ResponsesRequest),
        responses=error_responses(400, 401, 404, 413, 429, 503, 504),
    )
    async def responses(self, raw: Request):
        """OpenAI's Responses API, read as the chat completion it asks for (``app/responses_protocol.py``)."""
        return await self._serve(raw, ResponsesRequest, self.responses_format)

    @api.get("/v1/responses/{response_id}", response_model=None, responses=error_responses(401, 404))
    async def stored_response(self, response_id: str) -> JSONResponse:
        """Responses are not stored (``store`` is answered false): none can be retrieved."""
        message = f"No response with id '{response_id}': this server does not store responses."
        return HTTPError(404, error_body(message, "response_id", "invalid_request_error", "not_found")).response()

    @api.post(
        "/tokenize",
        response_model=None,
        openapi_extra=api.json_body(TokenizeCompletionRequest, TokenizeChatRequest),
        responses=error_responses(400, 401, 404, 413),
    )
    async def tokenize(self, raw: Request) -> dict | JSONResponse:
        """vLLM's: a prompt's token ids, as the generation endpoints make them."""
        return await self._holding_slot(raw, lambda _: self._tokenizer_call(raw, tokenize_schema, self._tokenized))

    def _tokenized(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        ids = body.token_ids(self.tokenizer, self.chat)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    @api.post(
        "/detokenize",
        response_model=None,
        openapi_extra=api.json_body(DetokenizeRequest),
        responses=error_responses(400, 401, 404, 413),
    )
    async def detokenize(self, raw: Request) -> dict | JSONResponse:
        """vLLM's: the text of token ids (at most ``max_model_len`` of them)."""
        answer = lambda body: {"prompt": body.text(self.tokenizer, self.limits)}  # noqa: E731
        return await self._holding_slot(raw, lambda _: self._tokenizer_call(raw, lambda _: DetokenizeRequest, answer))

    async def _tokenizer_call(
        self, raw: Request, schema_of: Callable[[dict], type], answer: Callable[[Any], dict]
    ) -> dict | JSONResponse:
        """A /tokenize or /detokenize body (of the schema ``schema_of`` picks), validated, naming
        this model if any, and ``answer``'s reply to it; a refusal as an OpenAI error body."""
        try:
            data = await self._read_json(raw)
            body = schema_of(data).model_validate(data)
            if body.model is not None and body.model != self.model:
                raise self._unknown_model(body.model)
            return answer(body)
        except ValidationError as exc:
            return HTTPError(400, validation_error_body(exc)).response()
        except FieldError as exc:
            return HTTPError.bad_request(exc).response()
        except HTTPError as exc:
            return exc.response()

    def _count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if self.tokenizer is not None else 0

    def _auth(self) -> ApiKeys | None:
        """The API keys (read now, from ``auth``), None when auth is off."""
        auth, limit = self.config.auth, self.config.limits.max_concurrent_per_key
        if not auth.enabled:
            if limit is not None:
                logger.warning("limits.max_concurrent_per_key=%d has no effect without auth (API keys)", limit)
            return None
        return ApiKeys(auth.keys(), on_refused=lambda: self.metrics.requests.inc(1, {"status": "401"}))

    # ---- one request --------------------------------------------------------------------

    async def _serve(self, raw: Request, schema: type, fmt: ResponseFormat | ResponsesFormat):
        """One generation request, holding its API key's slot for its whole life."""
        return await self._holding_slot(raw, lambda slot: self._respond(raw, schema, fmt, slot))

    async def _holding_slot(self, raw: Request, answer: Callable[[Slot], Awaitable[Any]]) -> Any:
        """``answer(slot)`` while holding the API key's slot (``limits.max_concurrent_per_key``):
        until the answer, or the last of its stream, has been sent; a 429 when none is free."""
        slot = self.key_slots.take(getattr(raw.state, KEY_ID, None))
        if slot is None:
            self.metrics.requests.inc(1, {"status": "429"})
            message = f"this API key has {self.key_slots.limit} requests in flight (limits.max_concurrent_per_key)"
            body = error_body(message, None, "requests", "rate_limit_exceeded")
            return HTTPError(429, body, {"Retry-After": "1"}).response()
        held = False
        try:
            response = await answer(slot)
            held = isinstance(response, HeldStreamingResponse)  # it releases the slot when sent
            return response
        finally:
            if not held:
                slot.release()

    async def _respond(self, raw: Request, schema: type, fmt: ResponseFormat | ResponsesFormat, slot: Slot):
        try:
            body = self._check_body(schema, await self._read_json(raw))
            client_id = raw.headers.get("x-request-id") or None  # Serve's proxy makes one up if need be
            # on the engines a client's id is made unique (a gateway may retry with it while the first
            # try is still held on a replica); logs find it by its prefix
            engine_id = body.new_request_id() if client_id is None else unique_request_id(client_id)
            request_id = client_id or engine_id  # the answer's id
            requests = self._to_engine(body, engine_id)
            choices = [choice for request in requests for choice in choice_requests(request, body.n)]
            self._admit()
        except HTTPError as exc:  # refused before any replica saw it: counted too
            self.metrics.requests.inc(1, {"status": str(exc.status)})
            return exc.response()
        text_of = self._text_of if requests[0].sampling.logprobs is not None else None
        shape = body.answer_shape(self.chat)
        echo = self._echo(body, requests) if getattr(body, "echo", False) else None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            writers = fmt.writers(body, request_id, self.model, choices, text_of, shape)
            stream = self._stream(writers, choices, body.n, include_usage, echo)
            return HeldStreamingResponse(stream, media_type="text/event-stream", slot=slot)
        self.in_flight += 1
        outputs: list[list[RequestOutput]] = [[] for _ in choices]
        try:
            async for index, output in self._choice_outputs(choices, body.n, echo):
                outputs[index].append(output)
        except HTTPError as exc:
            self.metrics.requests.inc(1, {"status": str(exc.status)})
            return exc.response()
        finally:
            self.in_flight -= 1
        scored = None if body.prompt_logprobs is None else PromptLogprobs(body.prompt_logprobs, self._text_of)
        # the X-Request-Id header: Serve's proxy echoes the client's (or the one it made up)
        return JSONResponse(fmt.full(body, request_id, self.model, outputs, text_of, shape, scored))

    async def _read_json(self, raw: Request) -> dict:
        try:
            # strict UTF-8 (RFC 8259): not the surrogates or UTF-16 that json.loads would take from bytes
            text = (await read_body(raw, self.config.limits.max_body_bytes)).decode("utf-8-sig")
            data = json.loads(text)
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
        if (problem := lone_surrogate(text, data)) is not None:
            raise HTTPError.bad_request(problem)
        return data

    def _check_body(self, schema: type, data: dict):
        """The body validated by its schema, for this model, with no unimplemented field set."""
        try:
            body = schema.model_validate(data)
        except ValidationError as exc:
            raise HTTPError(400, validation_error_body(exc)) from None
        if body.model != self.model:
            raise self._unknown_model(body.model)
        problem = unsupported(body)
        if problem is not None:
            raise HTTPError(400, error_body(problem[1], problem[0]))
        return body

    @staticmethod
    def _unknown_model(model: str) -> HTTPError:
        message = f"The model `{model}` does not exist."
        return HTTPError(404, error_body(message, "model", "invalid_request_error", "model_not_found"))

    def _to_engine(self, body: Any, request_id: str) -> list[GenerationRequest]:
        try:
            return body.to_generation_requests(self.tokenizer, self.limits, request_id, self.chat)
        except FieldError as exc:
            raise HTTPError.bad_request(exc) from None

    def _echo(self, body: CompletionRequest, requests: list[GenerationRequest]) -> Echo:
        """``echo``'s prompts: each as the client sent it (token ids decoded)."""
        decode = self.tokenizer.decode if self.tokenizer is not None else lambda ids: "".join(map(self._text_of, ids))
        texts = [p if isinstance(p, str) else decode(p) for p in body.batch() or [body.prompt]]
        if (keep := body.truncate_prompt_tokens) is not None:  # the prompts the engines got, where cut
            kept = self.max_model_len if keep == -1 else keep
            texts = [
                decode(list(r.prompt_token_ids)) if len(r.prompt_token_ids) == kept else t
                for r, t in zip(requests, texts)
            ]
        firsts = [r.prompt_token_ids[0] for r in requests]
        return Echo(texts, firsts, body.n, prompt_only=body.max_tokens == 0, num_top=body.logprobs)

    def _admit(self) -> None:
        """Refuse any request beyond the queue bound."""
        if self.in_flight >= self.config.max_queued_requests:
            raise HTTPError.busy("server busy: too many requests in flight")

    async def _stream(
        self,
        writers: list[ChunkWriter] | list[ResponseEvents],
        choices: list[GenerationRequest],
        per_prompt: int,
        include_usage: bool,
        echo: Echo | None = None,
    ) -> AsyncIterator[bytes]:
        """The SSE chunks of ``choices`` (``per_prompt`` of each prompt, in prompt order), each
        choice's written by its writer."""
        self.in_flight += 1
        try:
            for writer in writers:
                first = writer.start()
                if first:
                    yield first
            last: dict[int, RequestOutput] = {}
            async for index, output in self._choice_outputs(choices, per_prompt, echo):
                last[index] = output
                chunk = writers[index].delta(output)
                if chunk:
                    yield chunk
            if include_usage and len(last) == len(choices):
                yield writers[0].usage([last[i] for i in range(len(choices))], per_prompt)
        except HTTPError as exc:
            self.metrics.requests.inc(1, {"status": str(exc.status)})
            yield writers[0].error(exc.body)
        finally:
            self.in_flight -= 1
        if tail := writers[0].done():
            yield tail

    async def _choice_outputs(
        self, choices: list[GenerationRequest], per_prompt: int, echo: Echo | None = None
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The choices' outputs as they come, with the choice's index (``echo``: each choice's
        first starts with its prompt). With ``n`` > 1, each prompt's first choice runs alone until
        its first output: its prompt's KV is then in the prefix caches (the prefill replica's, and
        the decode replica's that fetched it), and the router sends the prompt's other choices where
        that prefix went, so the prompt is computed and moved once (not one whose prompt is scored:
        each choice computes it whole, none waits)."""
        if len(choices) == 1:
            async with aclosing(self.path.outputs(choices[0])) as outputs:
                async for output in outputs:
                    yield 0, echo(0, output) if echo else output
            return
        streams = [self.path.outputs(c) for c in choices]
        if choices[0].sampling.prompt_logprobs is not None:  # each computes its whole prompt: none waits
            per_prompt = 1
        async with aclosing(merge_after_first(streams, per_prompt)) as merged:
            async for index, output in merged:
                yield index, echo(index, output) if echo else output
