"""OpenAI-compatible request bodies and error bodies (validated once, at the edge).

Each request schema converts itself into the engine's ``GenerationRequest``
(``to_generation_request``): tokenized, checked against the context by ``check_fits``, with
every refusal a ``FieldError`` naming the client's field. Fields OpenAI defines that this
server does not implement are declared, so that a request setting one to anything but its
neutral value is refused naming it (``unsupported``) instead of being silently ignored;
unknown fields are ignored, as vLLM does. ``response_format`` (JSON object or JSON schema)
is checked here, against what the engine's grammar library can enforce, before the request
leaves the ingress.
"""

from __future__ import annotations

import uuid
from abc import abstractmethod
from typing import Any, ClassVar, Literal

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator

from engine.params import (
    LOGIT_BIAS_RANGE,
    PENALTY_RANGE,
    SEED_RANGE,
    ContextLimits,
    FieldError,
    GenerationRequest,
    SamplingParams,
    check_fits,
)
from engine.structured import JSON_OBJECT_SCHEMA, check_schema
from engine.tokenization import encode_prompt

MAX_CHOICES = 16  # ``n`` at most: each choice is a request of its own on the engines
# the engine divides (multiplies) float32 logits by it: far outside this range they overflow
# to inf, or 0 * inf gives NaN, and sampling fails (vLLM and HF take any value above 0)
REPETITION_PENALTY_RANGE = (0.01, 100.0)


class _Body(BaseModel):
    # NaN and infinity (Python's JSON reader takes the literals) are refused per field
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """OpenAI's optional fields are nullable (the openai SDK sends a ``None`` it is given):
        ``null`` means the default. A required field's ``null`` is still refused."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None
        }


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="send a final chunk with token usage")


class JsonSchemaFormat(_Body):
    name: str = Field(description="the schema's name (as OpenAI requires; not used)")
    description: str | None = Field(None, description="what the output is for (not used)")
    json_schema: dict[str, Any] | None = Field(
        None, alias="schema", description="the JSON schema the output must match (none: any JSON object)"
    )
    strict: bool | None = Field(None, description="accepted: the schema is always enforced")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = Field(description="text (no constraint) or JSON")
    json_schema: JsonSchemaFormat | None = Field(None, description="the schema, for type json_schema")

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is 'json_schema'")
        return self

    def to_schema(self) -> str | None:
        """``SamplingParams.json_schema``: None for text; ``FieldError`` naming
        ``response_format`` for a schema the grammar library cannot enforce."""
        if self.type == "text":
            return None
        if self.type == "json_object" or self.json_schema is None or self.json_schema.json_schema is None:
            return JSON_OBJECT_SCHEMA
        return check_schema(self.json_schema.json_schema)


class _SamplingFields(_Body):
    model: str = Field(description="model name from GET /v1/models")
    max_tokens: int | None = Field(None, description="tokens to generate (default: the rest of the context)")
    temperature: float = Field(1.0, description="below 1e-5 (0 included) is greedy")
    top_p: float = Field(1.0, description="nucleus sampling mass, in (0, 1]")
    top_k: int | None = Field(None, description="sample among the k most likely tokens (extension)")
    seed: int | None = Field(
        None, ge=SEED_RANGE[0], lt=SEED_RANGE[1], description="per-request seed for reproducible sampling"
    )
    stop: str | list[str] | None = Field(None, description="stop strings")
    stream: bool = Field(False, description="stream server-sent events")
    stream_options: StreamOptions | None = Field(None, description="streaming options")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices to generate (the prompt's KV computed and moved once)")
    ignore_eos: bool = Field(False, description="keep generating past end-of-sequence (extension)")
    min_tokens: int = Field(0, description="no EOS or stop token ids before this many tokens (extension)")
    user: str | None = Field(None, description="accepted, not used")
    presence_penalty: float = Field(
        0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1], description="subtracted from tokens already generated"
    )
    frequency_penalty: float = Field(
        0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1], description="subtracted per time a token was generated"
    )
    repetition_penalty: float = Field(
        1.0,
        ge=REPETITION_PENALTY_RANGE[0],
        le=REPETITION_PENALTY_RANGE[1],
        description="divides positive (multiplies negative) logits of tokens in the prompt or output (extension)",
    )
    logit_bias: dict[str, float] | None = Field(
        None, description=f"token id -> bias added to its logit, in {list(LOGIT_BIAS_RANGE)}"
    )
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema")

    id_prefix: ClassVar[str]  # of generated request ids, as OpenAI's
    prompt_field: ClassVar[str]  # the field that holds the prompt

    def to_generation_request(
        self, tokenizer: Any, limits: ContextLimits, request_id: str | None = None
    ) -> GenerationRequest:
        """Tokenize, check against the context and build the engine's request (``request_id``:
        the client's, else a new one). Raises ``FieldError`` naming the client's field."""
        self._check_consistent()
        ids = self._prompt_token_ids(tokenizer)
        limit_field, requested = self._max_tokens()
        if requested is not None and requested < 1:
            raise FieldError(f"{limit_field}: must be at least 1, got {requested}", limit_field)
        max_tokens = requested if requested is not None else limits.default_max_tokens(len(ids))
        check_fits(ids, max_tokens, limits, self.prompt_field, limit_field)
        sampling = self._sampling_params(max_tokens)
        if limits.vocab_size is not None:
            sampling.check_token_ids(limits.vocab_size)
        return GenerationRequest(
            request_id=request_id or f"{self.id_prefix}-{uuid.uuid4().hex}",
            prompt_token_ids=tuple(ids),
            sampling=sampling,
        )

    def _sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop or (),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=self._num_logprobs(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias or (),
            json_schema=self.response_format.to_schema() if self.response_format is not None else None,
        )

    def _prompt_token_ids(self, tokenizer: Any) -> list[int]:
        try:
            return encode_prompt(tokenizer, self._prompt())
        except ValueError as exc:
            raise FieldError(str(exc), self.prompt_field) from None

    def _check_consistent(self) -> None:
        """Cross-field rules that a schema alone does not state."""

    @abstractmethod
    def _prompt(self) -> Any:
        """What ``encode_prompt`` takes: the chat messages or the completion prompt."""

    def _max_tokens(self) -> tuple[str, int | None]:
        """The field that bounds the output, and its value."""
        return "max_tokens", self.max_tokens

    @abstractmethod
    def _num_logprobs(self) -> int | None:
        """Alternatives per output token (``SamplingParams.logprobs``), None when not asked."""

    def _refusals(self) -> list[tuple[str, bool]]:
        """``(field, refused)`` for every field declared only to be refused when set."""
        return []


class TextPart(_Body):
    type: Literal["text"] = Field(description="only text parts are supported")
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(description="author of the message")
    content: str | list[TextPart] = Field(description="message text, or a list of text parts")

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                if isinstance(part, dict) and part.get("type") not in (None, "text"):
                    raise ValueError(f"content parts of type {part.get('type')!r} are not supported, only 'text'")
        return value

    def for_template(self) -> dict[str, str]:
        """``{"role", "content"}`` for the chat template: text parts joined by newlines, as vLLM
        does; ``developer`` is OpenAI's newer name for ``system``, which templates know."""
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far")
    max_completion_tokens: int | None = Field(None, description="alias of max_tokens")
    logprobs: bool = Field(False, description="return the log-probability of each output token")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="alternatives per token (needs logprobs)")
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    id_prefix: ClassVar[str] = "chatcmpl"
    prompt_field: ClassVar[str] = "messages"

    def _check_consistent(self) -> None:
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs: needs logprobs: true", "top_logprobs")

    def _prompt(self) -> list[dict[str, str]]:
        return [m.for_template() for m in self.messages]

    def _prompt_token_ids(self, tokenizer: Any) -> list[int]:
        try:
            return super()._prompt_token_ids(tokenizer)
        except TemplateError as exc:  # e.g. a template that wants user and assistant to alternate
            message = f"messages: the model's chat template refused them: {exc}"
            raise FieldError(message, "messages") from None

    def _max_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def _num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _refusals(self) -> list[tuple[str, bool]]:
        return super()._refusals() + [
            ("tools", bool(self.tools)),
            ("tool_choice", self.tool_choice not in (None, "none")),
        ]


class CompletionRequest(_SamplingFields):
    prompt: str | list[StrictInt] = Field(description="prompt text or token ids")
    logprobs: int | None = Field(None, ge=0, le=20, description="top alternatives per output token")
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    id_prefix: ClassVar[str] = "cmpl"
    prompt_field: ClassVar[str] = "prompt"

    def _prompt(self) -> str | list[int]:
        return self.prompt

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    def _refusals(self) -> list[tuple[str, bool]]:
        return super()._refusals() + [
            ("echo", self.echo),
            ("best_of", self.best_of not in (None, 1)),
            ("suffix", bool(self.suffix)),
        ]

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
            if len(value) == 1:  # a batch of one (lm-eval-harness sends these): that prompt
                return value[0]
            raise ValueError("batched prompts (a list of strings or of token lists) are not supported: send one each")
        return value


def unsupported(body: _SamplingFields) -> tuple[str, str] | None:
    """``(field, message)`` for the first field set to something this server does not do."""
    for name, refused in body._refusals():
        if refused:
            value = repr(getattr(body, name))
            return name, f"{name}: {value if len(value) <= 60 else value[:57] + '...'} is not supported by this server"
    return None


class ErrorDetail(BaseModel):
    message: str = Field(description="what went wrong, naming the field when one is to blame")
    type: str = Field(description="invalid_request_error, server_error, requests (429) ...")
    param: str | None = Field(description="the request field at fault, if one is")
    code: str | None = Field(description="e.g. model_not_found, invalid_api_key, rate_limit_exceeded")


class ErrorResponse(BaseModel):
    """Every error's body, as OpenAI's (for the published schema; ``error_body`` builds them)."""

    error: ErrorDetail


def error_body(
    message: str, param: str | None, error_type: str = "invalid_request_error", code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _is_type_tag(part: object) -> bool:
    """Pydantic puts the union member tried (``str``, ``list[int]``) into an error's location."""
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "list", "dict"} or "[" in part)


def _field_loc(loc: tuple) -> tuple:
    """An error's location up to the first union member tag: the field it is about."""
    field: list = []
    for part in loc:
        if _is_type_tag(part):
            break
        field.append(part)
    return tuple(field)


def validation_error_body(exc: ValidationError) -> dict:
    """The first problem, naming the field as OpenAI does (``param``). Of the alternatives of the
    same union the deepest is the one meant (``[true]`` as a prompt: item 0, not "not a string")."""
    errors = exc.errors()
    field = _field_loc(errors[0]["loc"])
    first = max((e for e in errors if _field_loc(e["loc"]) == field), key=lambda e: len(e["loc"]))
    param = ".".join(str(p) for p in first["loc"] if not _is_type_tag(p)) or None
    message = first["msg"].removeprefix("Value error, ")
    return error_body(f"{param}: {message}" if param else message, param)
