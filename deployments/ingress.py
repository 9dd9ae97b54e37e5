"""The OpenAI-compatible ingress (FastAPI through ``serve.ingress``).

Per request: parse and validate the body (400 naming the field), check the model (404),
tokenize (the chat template for chat), check lengths against the context (400 with the
limit), then send it to prefill and then to decode (or to a colocated replica) and stream
the tokens back. Backpressure: at most ``max_queued_requests`` requests in flight per
ingress replica; beyond that 503 with ``Retry-After``. A client that goes away cancels the
replica calls, which abort the request and free its blocks on every replica.
"""

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from pydantic import ValidationError
from ray import serve

from app.config import AppConfig
from app.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    unsupported,
    validation_error_body,
)
from deployments.metrics import IngressMetrics
from deployments.openai_format import ChunkWriter, full_response, sse, token_text_of
from engine.loader import ModelSpec, load_tokenizer, model_name
from engine.params import GenerationRequest, RequestOutput, SamplingParams
from engine.tokenization import encode_prompt

logger = logging.getLogger(__name__)
api = FastAPI(title="tandem", docs_url=None, redoc_url=None)


class HTTPError(Exception):
    def __init__(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        super().__init__(body["error"]["message"])
        self.status, self.body, self.headers = status, body, headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, config: dict[str, Any], prefill: Any = None, decode: Any = None, colocated: Any = None):
        self.config = AppConfig.model_validate(config)
        spec = ModelSpec(source=self.config.model.source)
        self.tokenizer = load_tokenizer(spec)
        self._text_of = token_text_of(self.tokenizer)
        self.model = self.config.model.served_name or model_name(spec)
        self.max_model_len = self.config.model.max_model_len
        self.prefill, self.decode, self.colocated = prefill, decode, colocated
        self.in_flight = 0
        self._active_ids: set[str] = set()
        self.metrics = IngressMetrics()

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

    @api.post("/v1/chat/completions")
    async def chat(self, raw: Request):
        return await self._serve("chat", ChatCompletionRequest, raw)

    @api.post("/v1/completions")
    async def completions(self, raw: Request):
        return await self._serve("completion", CompletionRequest, raw)

    # ---- one request --------------------------------------------------------------------

    async def _serve(self, kind: str, schema: type, raw: Request):
        try:
            body = await self._parse(schema, raw)
            request = self._to_engine(kind, body, raw.headers.get("x-request-id"))
        except HTTPError as exc:
            return exc.response()
        if request.request_id in self._active_ids:
            message = f"X-Request-Id: request id {request.request_id!r} is already in flight"
            return HTTPError(400, error_body(message, "X-Request-Id")).response()
        if self.in_flight >= self.config.max_queued_requests:
            return HTTPError(
                503, error_body("server busy: too many requests in flight", None, "server_error"), {"Retry-After": "1"}
            ).response()
        self._active_ids.add(request.request_id)  # discarded when _timed ends
        headers = {"X-Request-Id": request.request_id}
        text_of = self._text_of if request.sampling.logprobs is not None else None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = self._stream(kind, request, include_usage, text_of)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        self.in_flight += 1
        try:
            outputs = [o async for o in self._timed(request)]
        except HTTPError as exc:
            self.metrics.requests.inc(1, {"status": str(exc.status)})
            return exc.response()
        finally:
            self.in_flight -= 1
        body = full_response(kind, request.request_id, self.model, outputs, text_of)
        return JSONResponse(body, headers=headers)

    async def _parse(self, schema: type, raw: Request):
        try:
            data = json.loads(await raw.body())
        # JSONDecodeError and UnicodeDecodeError are ValueErrors, as is an integer of over
        # 4,300 digits; very deep nesting is a RecursionError
        except (ValueError, RecursionError) as exc:
            raise HTTPError(400, error_body(f"malformed JSON body: {exc}", None)) from None
        if not isinstance(data, dict):
            raise HTTPError(400, error_body("the body must be a JSON object", None))
        try:
            body = schema.model_validate(data)
        except ValidationError as exc:
            raise HTTPError(400, validation_error_body(exc)) from None
        if body.model != self.model:
            raise HTTPError(
                404,
                error_body(
                    f"The model `{body.model}` does not exist.", "model", "invalid_request_error", "model_not_found"
                ),
            )
        problem = unsupported(body)
        if problem is not None:
            raise HTTPError(400, error_body(problem[1], problem[0]))
        if isinstance(body, ChatCompletionRequest) and body.top_logprobs and not body.logprobs:
            raise HTTPError(400, error_body("top_logprobs: needs logprobs: true", "top_logprobs"))
        return body

    def _to_engine(self, kind: str, body: Any, client_id: str | None) -> GenerationRequest:
        if kind == "chat":
            prompt, field = [m.for_template() for m in body.messages], "messages"
        else:
            prompt, field = body.prompt, "prompt"
        try:
            ids = encode_prompt(self.tokenizer, prompt)
        except ValueError as exc:
            raise HTTPError(400, error_body(str(exc), field)) from None
        except TemplateError as exc:  # e.g. a template that wants user and assistant to alternate
            message = f"messages: the model's chat template refused them: {exc}"
            raise HTTPError(400, error_body(message, field)) from None
        if isinstance(prompt, list) and kind != "chat" and self.tokenizer is not None:
            if (largest := max(ids)) >= len(self.tokenizer):
                message = f"prompt: token id {largest} is out of vocabulary (the tokenizer has {len(self.tokenizer)})"
                raise HTTPError(400, error_body(message, field))
        if len(ids) >= self.max_model_len:
            raise HTTPError(
                400,
                error_body(
                    f"{field}: the prompt is {len(ids)} tokens; this model's context is {self.max_model_len} tokens",
                    field,
                ),
            )
        room = self.max_model_len - len(ids)
        chat_limit = kind == "chat" and body.max_completion_tokens is not None
        limit_field = "max_completion_tokens" if chat_limit else "max_tokens"
        max_tokens = body.max_completion_tokens if chat_limit else body.max_tokens
        if max_tokens is None:
            max_tokens = room
        elif max_tokens < 1:
            raise HTTPError(400, error_body(f"{limit_field}: must be at least 1, got {max_tokens}", limit_field))
        if max_tokens > room:
            raise HTTPError(
                400,
                error_body(
                    f"{limit_field}: {max_tokens} is beyond the context: prompt {len(ids)} tokens + {limit_field} > "
                    f"{self.max_model_len}",
                    limit_field,
                ),
            )
        if kind == "chat":
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            logprobs = body.logprobs
        try:
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=body.seed,
                stop=body.stop or (),
                ignore_eos=body.ignore_eos,
                min_tokens=body.min_tokens,
                logprobs=logprobs,
            )
            prefix = "chatcmpl" if kind == "chat" else "cmpl"
            return GenerationRequest(client_id or f"{prefix}-{uuid.uuid4().hex}", tuple(ids), sampling)
        except ValueError as exc:
            param = str(exc).split(" ", 1)[0]
            raise HTTPError(400, error_body(str(exc), param)) from None

    async def _stream(
        self, kind: str, request: GenerationRequest, include_usage: bool, text_of: Any
    ) -> AsyncIterator[bytes]:
        writer = ChunkWriter(kind, request.request_id, self.model, text_of)
        self.in_flight += 1
        try:
            first = writer.start()
            if first:
                yield first
            last = None
            async for output in self._timed(request):
                last = output
                chunk = writer.delta(output)
                if chunk:
                    yield chunk
            if include_usage and last is not None:
                yield writer.usage(last)
        except HTTPError as exc:
            self.metrics.requests.inc(1, {"status": str(exc.status)})
            yield sse(exc.body)
        finally:
            self.in_flight -= 1
        yield writer.done()

    async def _timed(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """``_outputs`` with TTFT / TPOT / E2E recorded (TTFT: the first token leaving here)."""
        start, first, num_tokens = time.perf_counter(), None, 0
        try:
            async for output in self._outputs(request):
                if first is None and output.token_ids:
                    first = time.perf_counter()
                num_tokens += len(output.token_ids)
                yield output
        finally:
            self._active_ids.discard(request.request_id)
        path = "colocated" if self.colocated is not None else "disaggregated"
        self.metrics.observe(path, start, first, time.perf_counter(), num_tokens)
        self.metrics.requests.inc(1, {"status": "200"})

    async def _outputs(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Route one request through prefill and decode (or a colocated replica)."""
        prefill_call = None
        if self.colocated is not None:
            stream = self.colocated.options(stream=True).generate.remote(request)
        elif len(request.prompt_token_ids) < self.config.disagg_min_prompt_tokens:
            stream = self.decode.options(stream=True).generate.remote(request)
        elif self.config.transport.mode == "pull":
            hop_start = time.perf_counter()
            result, handle = await self._call(self.prefill.prefill.remote(request))
            self.metrics.prefill_hop.observe(time.perf_counter() - hop_start)
            if handle is None:  # ended at its first token
                yield RequestOutput(
                    request.request_id,
                    (result.first_token,),
                    result.first_text,
                    True,
                    result.finish_reason,
                    result.num_tokens,
                    1,
                    logprobs=(result.first_logprobs,) if result.first_logprobs is not None else (),
                )
                return
            # the decode replica has no logits for the first token: its log-probabilities
            # go along (in push mode inside the push's completion notice)
            stream = self.decode.options(stream=True).decode_pull.remote(request, handle, result.first_logprobs)
        else:
            stream = self.decode.options(stream=True).decode_push.remote(request)
            destination = await self._call(stream.__anext__())
            prefill_call = self.prefill.prefill_push.remote(request, destination)
        finished = False
        try:
            async for output in self._iterate(stream):
                finished = output.finished
                yield output
            if prefill_call is not None:
                await self._call(prefill_call)
        finally:
            if not finished:  # client gone or an error: cancelling aborts on the replicas
                stream.cancel()
                if prefill_call is not None:
                    prefill_call.cancel()

    async def _iterate(self, stream: Any) -> AsyncIterator[RequestOutput]:
        while True:
            try:
                output = await self._call(stream.__anext__())
            except StopAsyncIteration:
                return
            yield output

    async def _call(self, awaitable: Any) -> Any:
        """Await a replica call; map what it raises to an HTTP error (never a stack trace)."""
        try:
            return await awaitable
        except (StopAsyncIteration, asyncio.CancelledError):
            raise
        except Exception as exc:
            cause = getattr(exc, "cause", exc)
            name = type(cause).__name__
            if name == "KVCapacityError":
                raise HTTPError(
                    503,
                    error_body("no KV capacity on the decode pool, retry later", None, "server_error"),
                    {"Retry-After": "1"},
                ) from None
            if name == "ValueError":  # the engine refused the request's input (e.g. a duplicate id)
                param = "prompt" if str(cause).startswith("prompt") else None
                raise HTTPError(400, error_body(str(cause), param)) from None
            logger.exception("request failed")
            raise HTTPError(500, error_body(f"internal error ({name})", None, "server_error")) from None
