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

import functools
import inspect
import json
import re
import uuid
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from jinja2 import TemplateError
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictInt,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from app.tool_calls import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    AnswerShape,
    ReasoningParser,
    ToolParser,
    parser_for_template,
)
from app.tool_schemas import bounded, forced_schema
from engine.params import (
    LOGIT_BIAS_RANGE,
    PENALTY_RANGE,
    SEED_RANGE,
    ContextLimits,
    FieldError,
    GenerationRequest,
    SamplingParams,
    bad_word_ids,
    check_fits,
)
from engine.structured import after_reasoning, check_schema, choice_lark, grammar_lark, regex_lark
from engine.structured import lark_grammar as check_lark
from engine.tokenization import encode_prompt

MAX_CHOICES = 16  # ``n`` at most: each choice is a request of its own on the engines
COMPLETION_MAX_TOKENS = 16  # /v1/completions' max_tokens when left out (OpenAI's and vLLM's default)
MAX_BATCH_CHOICES = 64  # a batched completion's prompts x n at most: each a request of its own on the engines
# the engine divides (multiplies) float32 logits by it: far outside this range they overflow
# to inf, or 0 * inf gives NaN, and sampling fails (vLLM and HF take any value above 0)
REPETITION_PENALTY_RANGE = (0.01, 100.0)


class _Body(BaseModel):
    # NaN and infinity (Python's JSON reader takes the literals) are refused per field. Strict,
    # as OpenAI's API: a JSON type other than the field's is refused by name (``true`` or
    # ``"10"`` for an integer, ``"0.5"`` for a number, ``1`` for a boolean); an integer is a number
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

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
    continuous_usage_stats: bool = Field(
        False, description="with include_usage, every chunk carries its choice's usage so far, as vLLM's (extension)"
    )


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
        schema = {"type": "object"}  # json_object, or a json_schema without a schema
        if self.type == "json_schema" and self.json_schema is not None and self.json_schema.json_schema is not None:
            schema = self.json_schema.json_schema
        return _checked_schema(schema, "response_format")


def _checked_schema(schema: Any, field: str) -> str:
    """``check_schema`` of a client's schema, its unbounded integers bounded (``bounded``)."""
    try:
        return check_schema(bounded(schema) if isinstance(schema, dict) else schema, field)
    except RecursionError:
        raise FieldError(f"{field}: the JSON schema is nested too deeply", field) from None


# request fields of vLLM's (and OpenAI's older or audio ones) that this server does not implement,
# with their neutral value: any other (but null) is refused by name, never ignored
NOT_IMPLEMENTED: dict[str, Any] = {
    "use_beam_search": False,
    "spaces_between_special_tokens": True,
    "logits_processors": None,
    "guided_whitespace_pattern": None,
    "structural_tag": None,
}
CHAT_NOT_IMPLEMENTED: dict[str, Any] = {
    "best_of": 1,
    "functions": None,
    "function_call": ("none", "auto"),
    "audio": None,
    "modalities": ["text"],
    "web_search_options": None,
    "chat_template": None,
    "documents": None,
    "echo": False,
    "add_special_tokens": False,  # the template writes them
}
# vLLM's output constraints, by kind: the older fields, and the keys of its newer ``structured_outputs``
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object")
# and its options, with their neutral values (``disable_any_whitespace`` and the backend's are
# ignored: JSON is written without free whitespace here, and llguidance is the one backend)
STRUCTURED_OUTPUTS_REFUSED = {
    "structural_tag": None,
    "whitespace_pattern": None,
    "disable_additional_properties": False,
}
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 256, 256  # each checked against the output's tail every step
MAX_ALLOWED_TOKEN_IDS = 32_768  # the engine masks the rest of the vocabulary with them every step
# ``apply_chat_template``'s own arguments, which ``chat_template_kwargs`` may not set (the request's
# fields do: messages, tools, the template options), nor any name starting with an underscore
TEMPLATE_ARGUMENTS = frozenset(
    "self conversation conversations messages tools documents chat_template add_generation_prompt "
    "continue_final_message tokenize padding truncation max_length return_tensors return_dict "
    "return_assistant_tokens_mask tokenizer_kwargs raise_exception strftime_now namespace range dict cycler "
    "joiner lipsum".split()
)


@functools.cache
def _template_arguments(tokenizer_class: type) -> frozenset[str]:
    """``TEMPLATE_ARGUMENTS`` and the installed transformers' ``apply_chat_template`` arguments."""
    return TEMPLATE_ARGUMENTS | inspect.signature(tokenizer_class.apply_chat_template).parameters.keys()


def _neutral(value: Any, neutral: Any) -> bool:
    """Whether ``value`` asks nothing of a field whose neutral value (or values: a tuple) is
    ``neutral``; an object of nulls asks nothing either (e.g. ``{"effort": null}``)."""
    if value is None or value == neutral or (isinstance(neutral, tuple) and value in neutral):
        return True
    if isinstance(value, dict) and value and all(v is None for v in value.values()):
        return True
    return neutral is None and value in ([], {}, "")


class _Refusing(_Body):
    """A body that knows some fields only to refuse them when set (``unsupported``)."""

    # kept (``model_extra``), so that a field of ``not_implemented`` can be refused by name
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    not_implemented: ClassVar[dict[str, Any]] = {}

    def _refusals(self) -> list[tuple[str, bool]]:
        """``(field, refused)`` for every field declared, or known, only to be refused when set."""
        extra = self.model_extra or {}
        return [(name, name in extra and not _neutral(extra[name], v)) for name, v in self.not_implemented.items()]


class _GenerationBody(_Refusing):
    """A generation request's body: its id, and how its answer is read."""

    not_implemented: ClassVar[dict[str, Any]] = NOT_IMPLEMENTED
    id_prefix: ClassVar[str]

    def new_request_id(self) -> str:
        return f"{self.id_prefix}-{uuid.uuid4().hex}"

    def answer_shape(self, chat: ChatSetup) -> AnswerShape | None:
        """How the answer is read (reasoning, tool calls); None: as plain text, untouched."""
        return None


class _SamplingFields(_GenerationBody):
    model: str = Field(description="model name from GET /v1/models")
    max_tokens: int | None = Field(None, description="tokens to generate (default: the rest of the context)")
    temperature: float = Field(1.0, description="below 1e-5 (0 included) is greedy")
    top_p: float = Field(1.0, description="nucleus sampling mass, in (0, 1]")
    top_k: int | None = Field(
        None, description="sample among the k most likely tokens; 0 or -1: all of them, as vLLM's (extension)"
    )
    min_p: float = Field(
        0.0, description="drop tokens less likely than min_p times the most likely one, in [0, 1] (extension)"
    )
    seed: int | None = Field(
        None, ge=SEED_RANGE[0], lt=SEED_RANGE[1], description="per-request seed for reproducible sampling"
    )
    stop: str | list[str] | None = Field(None, description="stop strings")
    stop_token_ids: list[StrictInt] | None = Field(
        None,
        max_length=MAX_STOP_TOKEN_IDS,
        description="token ids that end the output, their text left out, as vLLM's (extension)",
    )
    include_stop_str_in_output: bool = Field(
        False, description="the stop string or stop token that ended the output stays in it, as vLLM's (extension)"
    )
    allowed_token_ids: list[StrictInt] | None = Field(
        None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS, description="the only token ids it may generate (vLLM's)"
    )
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]] | None = Field(
        None, max_length=MAX_BAD_WORDS, description="words it may not generate, as vLLM's (extension)"
    )
    skip_special_tokens: bool = Field(
        True, description="leave special tokens (e.g. <|im_end|>) out of the text, as vLLM's (extension)"
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="each prompt token's log-probability, rank and this many alternatives, as vLLM's (extension); "
        "not with stream",
    )
    truncate_prompt_tokens: StrictInt | None = Field(
        None, description="keep only the prompt's last k tokens; -1: the last max_model_len, as vLLM's (extension)"
    )
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
        self, tokenizer: Any, limits: ContextLimits, request_id: str | None = None, chat: ChatSetup | None = None
    ) -> GenerationRequest:
        """Tokenize (a chat as ``chat`` says), check against the context and build the engine's
        request (``request_id``: the client's, else a new one). Raises ``FieldError`` naming the
        client's field."""
        chat = chat or ChatSetup()
        ids = self._truncated(self.prompt_token_ids(tokenizer, chat), limits)
        limit_field, requested = self._max_tokens()
        if requested is not None and requested < 1:
            raise FieldError(f"{limit_field}: must be at least {self._fewest_tokens()}, got {requested}", limit_field)
        max_tokens = requested if requested is not None else self._default_max_tokens(limits, len(ids))
        check_fits(ids, max_tokens, limits, self.prompt_field, limit_field)
        sampling = self._sampling_params(max_tokens, chat, self._bad_word_ids(tokenizer))
        if limits.vocab_size is not None:
            sampling.check_token_ids(limits.vocab_size)
        return GenerationRequest(
            request_id=request_id or self.new_request_id(),
            prompt_token_ids=tuple(ids),
            sampling=sampling,
        )

    def to_generation_requests(
        self, tokenizer: Any, limits: ContextLimits, request_id: str, chat: ChatSetup | None = None
    ) -> list[GenerationRequest]:
        """The engine requests of this body's prompts, in order: one, but for a batched completion."""
        return [self.to_generation_request(tokenizer, limits, request_id, chat)]

    def prompt_token_ids(self, tokenizer: Any, chat: ChatSetup | None = None) -> list[int]:
        """The prompt's token ids, as the engine gets them (before ``truncate_prompt_tokens``),
        its fields checked first (``FieldError`` naming the client's field)."""
        self._check_consistent()
        return self._prompt_token_ids(tokenizer, chat or ChatSetup())

    def _truncated(self, ids: list[int], limits: ContextLimits) -> list[int]:
        """``truncate_prompt_tokens``: the last k ids (-1: the last ``max_model_len``)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep != -1 and not 1 <= keep <= limits.max_model_len:
            message = f"must be -1 or in [1, {limits.max_model_len}] (max_model_len), got {keep}"
            raise FieldError(f"truncate_prompt_tokens: {message}", "truncate_prompt_tokens")
        return ids[-(limits.max_model_len if keep == -1 else keep) :]

    def _bad_word_ids(self, tokenizer: Any) -> tuple[tuple[int, ...], ...]:
        """``bad_words`` as the engine takes them (``bad_word_ids``)."""
        if not self.bad_words:
            return ()
        for i, word in enumerate(self.bad_words):
            if not word.strip():
                raise FieldError(f"bad_words.{i}: a word must not be only white space", f"bad_words.{i}")
        if tokenizer is None:
            raise FieldError("bad_words: this model has no tokenizer (dummy weights)", "bad_words")
        return bad_word_ids(tokenizer, self.bad_words)

    def _sampling_params(self, max_tokens: int, chat: ChatSetup, bad_words: tuple = ()) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=None if self.top_k in (0, -1) else self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop or (),
            stop_token_ids=self.stop_token_ids or (),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=self._num_logprobs(),
            prompt_logprobs=self._num_prompt_logprobs(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias or (),
            allowed_token_ids=self.allowed_token_ids or (),
            bad_words_token_ids=bad_words,
            **self._grammar(chat),
        )

    def _grammar(self, chat: ChatSetup) -> dict[str, str | None]:
        """The grammar the output is generated under: ``SamplingParams.json_schema`` or
        ``lark_grammar`` (and ``grammar_field``, the field it came from), from
        ``response_format`` or one of vLLM's constraints (``_guided``)."""
        guided = self._guided()
        if guided is None:
            return {"json_schema": self.response_format.to_schema() if self.response_format is not None else None}
        field, grammar = guided
        if self.response_format is not None and self.response_format.type != "text":
            raise FieldError(f"{field}: cannot be combined with response_format", field)
        return grammar

    def _guided(self) -> tuple[str, dict[str, str | None]] | None:
        """vLLM's output constraint, if one is set: ``guided_json``, ``guided_regex``,
        ``guided_choice`` or ``guided_grammar`` (Lark or GBNF), or the same in ``structured_outputs``
        (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``), as (its field, the
        grammar); ``FieldError`` naming the field."""
        asked = self._guided_fields()
        if not asked:
            return None
        if len(asked) > 1:
            raise FieldError(f"{asked[1][0]}: cannot be combined with {asked[0][0]}", asked[1][0])
        field, kind, value = asked[0]
        lark = {"regex": regex_lark, "choice": choice_lark, "grammar": grammar_lark}.get(kind)
        if lark is not None:
            return field, {"json_schema": None, "lark_grammar": lark(value, field), "grammar_field": field}
        schema = _guided_schema({"type": "object"} if kind == "json_object" else value, field)
        return field, {"json_schema": schema, "grammar_field": field}

    def _guided_fields(self) -> list[tuple[str, str, Any]]:
        """The constraints of ``_guided`` that are set: (field, kind, value)."""
        extra = self.model_extra or {}
        asked = [(name, GUIDED[name], extra[name]) for name in GUIDED if extra.get(name) is not None]
        outputs = extra.get("structured_outputs")
        if outputs is None:
            return asked
        field = "structured_outputs"
        if not isinstance(outputs, dict):
            raise FieldError(f"{field}: must be an object", field)
        for key, neutral in STRUCTURED_OUTPUTS_REFUSED.items():
            if not _neutral(outputs.get(key), neutral):
                raise FieldError(f"{field}.{key}: {outputs[key]!r} is not supported by this server", field)
        if outputs.get("json_object") not in (None, True, False):
            raise FieldError(f"{field}.json_object: must be a boolean", field)
        wanted = [key for key in STRUCTURED_OUTPUTS if outputs.get(key) not in (None, False)]
        return asked + [(f"{field}.{key}", key, outputs[key]) for key in wanted]

    def _prompt_token_ids(self, tokenizer: Any, chat: ChatSetup) -> list[int]:
        try:
            return encode_prompt(tokenizer, self._prompt(), add_special_tokens=self._special_tokens())
        except ValueError as exc:
            raise FieldError(str(exc), self.prompt_field) from None
        except TypeError as exc:  # text the tokenizer cannot take
            raise FieldError(f"{self.prompt_field}: cannot be tokenized: {exc}", self.prompt_field) from None

    def _special_tokens(self) -> bool:
        """Whether a text prompt gets the tokenizer's special tokens (a BOS)."""
        return False

    def _check_consistent(self) -> None:
        """Cross-field rules that a schema alone does not state."""
        if self.prompt_logprobs is not None and self.stream:  # as vLLM: the scores come with the first output
            raise FieldError("prompt_logprobs: not available when stream is true", "prompt_logprobs")

    @abstractmethod
    def _prompt(self) -> Any:
        """What ``encode_prompt`` takes: the chat messages or the completion prompt."""

    def _max_tokens(self) -> tuple[str, int | None]:
        """The field that bounds the output, and its value."""
        return "max_tokens", self.max_tokens

    def _fewest_tokens(self) -> int:
        """The least output bound a client may ask for."""
        return 1

    def _default_max_tokens(self, limits: ContextLimits, num_prompt_tokens: int) -> int:
        """The output bound of a request that sets none: the rest of the context, at most the cap."""
        return limits.default_max_tokens(num_prompt_tokens)

    @abstractmethod
    def _num_logprobs(self) -> int | None:
        """Alternatives per output token (``SamplingParams.logprobs``), None when not asked."""

    def _num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token (``SamplingParams.prompt_logprobs``), None when not asked."""
        return self.prompt_logprobs


class TextPart(_Body):
    type: Literal["text"] = Field(description="only text parts are supported")
    text: str


class FunctionCall(_Body):
    name: str = Field(description="the function called")
    arguments: str = Field(description="its arguments, JSON text of an object")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            decoded = json.loads(value)
        except (ValueError, RecursionError):
            raise ValueError("must be JSON text of an object") from None
        if not isinstance(decoded, dict):
            raise ValueError("must be JSON text of an object")
        return value


class MessageToolCall(_Body):
    id: str = Field(description="the call's id, which the tool message answering it names")
    type: Literal["function"] = Field("function", description="only functions")
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(description="author of the message")
    tool_calls: list[MessageToolCall] | None = Field(None, description="an assistant's calls")
    content: str | list[TextPart] | None = Field(
        None, validate_default=True, description="message text, or a list of text parts"
    )
    tool_call_id: str | None = Field(None, validate_default=True, description="a tool message: the call it answers")
    name: str | None = Field(None, description="the author's name (passed to the template)")

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                if isinstance(part, dict) and part.get("type") not in (None, "text"):
                    raise ValueError(f"content parts of type {part.get('type')!r} are not supported, only 'text'")
        return value

    @field_validator("content")
    @classmethod
    def _content_or_calls(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("Field required (an assistant message may carry tool_calls instead)")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _answers_a_call(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("role") == "tool" and not value:
            raise ValueError("Field required in a tool message")
        return value

    def for_template(self) -> dict[str, Any]:
        """The message for the chat template: text parts joined by newlines, as vLLM does;
        ``developer`` is OpenAI's newer name for ``system``, which templates know; a call's
        arguments decoded (templates write them with ``tojson``)."""
        text = self.content if isinstance(self.content, str | None) else "\n".join(p.text for p in self.content)
        item: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text or ""}
        if self.tool_calls:
            item["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _decoded(c)}}
                for c in self.tool_calls
            ]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                item[key] = getattr(self, key)
        return item


def _guided_schema(schema: Any, field: str) -> str:
    """A vLLM ``guided_json``: a JSON schema, as an object or its JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            raise FieldError(f"{field}: must be a JSON schema, as an object or its JSON text", field) from None
    return _checked_schema(schema, field)


def _checked_lark(text: str) -> str:
    """A lazy tool-call grammar, checked by llguidance (``FieldError`` naming ``tools``)."""
    check_lark(text)
    return text


def _decoded(call: MessageToolCall) -> Any:
    return json.loads(call.function.arguments)  # checked to parse (``FunctionCall``)


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$", description="the function's name")
    description: str | None = Field(None, description="what it does, for the model")
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}}, description="its arguments, a JSON Schema"
    )
    strict: bool | None = Field(None, description="accepted: forced calls always follow the schema")

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type", "object") != "object":
            raise ValueError("must be a JSON Schema of type object")
        try:
            check_schema(forced_schema([{"name": "f", "parameters": value}], "f", False), field="parameters")
        except FieldError as exc:
            raise ValueError(str(exc).removeprefix("parameters: ")) from None
        except RecursionError:
            raise ValueError("the JSON Schema is nested too deeply") from None
        return value


class Tool(_Body):
    type: Literal["function"] = Field(description="only functions")
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = Field(description="only functions")
    function: FunctionName


_SHIPPED_TOOLS_TEMPLATE = Path(__file__).parent / "templates" / "chatml_tools.jinja"


@dataclass(frozen=True)
class ChatSetup:
    """How chat requests are rendered and their answers read (``api``): ``template`` in place
    of the model's own (None: its own); ``tools_template`` for requests with tools (None: the
    model renders none); the tool-call and reasoning parsers."""

    template: str | None = None
    tools_template: str | None = None
    tool_parser: type[ToolParser] | None = None
    reasoning: ReasoningParser | None = None

    @classmethod
    def of(cls, own: str | None, template: str | None, tool_parser: str | None, reasoning: str | None) -> ChatSetup:
        """``own``: the model's template; the other arguments as ``api``'s settings. A ChatML template
        that renders no tools gets the project's ChatML template with Hermes-style tools for them."""
        chosen = template or own or ""
        tools = chosen if re.search(r"\btools\b", chosen) else None
        if tools is None and "<|im_start|>" in chosen:
            tools = _SHIPPED_TOOLS_TEMPLATE.read_text()
        parser = tool_parser or parser_for_template(tools)
        return cls(
            template=template,
            tools_template=tools,
            tool_parser=TOOL_PARSERS[parser] if parser else None,
            reasoning=REASONING_PARSERS[reasoning] if reasoning else None,
        )


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far")
    max_completion_tokens: int | None = Field(None, description="alias of max_tokens")
    logprobs: bool = Field(False, description="return the log-probability of each output token")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="alternatives per token (needs logprobs)")
    tools: list[Tool] | None = Field(None, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or one named function"
    )
    parallel_tool_calls: bool = Field(True, description="more than one call in an answer")
    add_generation_prompt: bool = Field(True, description="end the prompt with the assistant's turn (vLLM's)")
    continue_final_message: bool = Field(
        False, description="continue the last message, an assistant's, instead of starting a new one (vLLM's)"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="variables for the chat template, e.g. enable_thinking (vLLM's)"
    )

    id_prefix: ClassVar[str] = "chatcmpl"
    prompt_field: ClassVar[str] = "messages"
    not_implemented: ClassVar[dict[str, Any]] = NOT_IMPLEMENTED | CHAT_NOT_IMPLEMENTED

    def _check_consistent(self) -> None:
        super()._check_consistent()
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs: needs logprobs: true", "top_logprobs")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise FieldError("tools: two functions have the same name", "tools")
        if self.tool_choice not in (None, "none") and not names:
            raise FieldError("tool_choice: needs tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise FieldError(f"tool_choice: no function {self.tool_choice.function.name!r} in tools", "tool_choice")
        if self.forced_tools and self.response_format is not None and self.response_format.type != "text":
            raise FieldError("response_format: cannot be combined with a forced tool_choice", "response_format")
        if names and self.tool_choice != "none" and (guided := self._guided_fields()):
            raise FieldError(f"{guided[0][0]}: cannot be combined with tools", guided[0][0])
        if self.forced_tools and self.stop:  # a stop string would cut a call the grammar keeps whole
            raise FieldError("stop: cannot be combined with a forced tool_choice", "stop")
        called: set[str] = set()
        for i, message in enumerate(self.messages):
            called |= {c.id for c in message.tool_calls or ()}
            if message.role == "tool" and message.tool_call_id not in called:
                field = f"messages.{i}.tool_call_id"
                raise FieldError(f"{field}: {message.tool_call_id!r} answers no earlier tool call", field)

    def _template_options(self, tokenizer: Any) -> dict[str, Any]:
        """``encode_prompt``'s: vLLM's template fields, checked; a variable may not take the name
        of an argument of the template call (the installed transformers' too) or of a function
        the template may call."""
        variables = self.chat_template_kwargs or {}
        arguments = _template_arguments(type(tokenizer))
        if taken := sorted(k for k in variables if k in arguments or k.startswith("_")):
            message = f"chat_template_kwargs: {taken[0]!r} is reserved (the request's fields set the call's arguments)"
            raise FieldError(message, "chat_template_kwargs")
        if self.continue_final_message and self.add_generation_prompt:
            message = "continue_final_message: needs add_generation_prompt false (the assistant's turn is continued)"
            raise FieldError(message, "continue_final_message")
        last = self.messages[-1]
        if self.continue_final_message and (last.role != "assistant" or last.tool_calls):
            message = "continue_final_message: the last message must be the assistant's, without tool calls"
            raise FieldError(message, "continue_final_message")
        fields = {"add_generation_prompt": self.add_generation_prompt}
        return variables | fields | ({"continue_final_message": True} if self.continue_final_message else {})

    @property
    def forced_tools(self) -> bool:
        """``tool_choice`` required or a named function: the answer is generated as calls."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    @property
    def _tool_history(self) -> bool:
        return any(m.role == "tool" or m.tool_calls for m in self.messages)

    def _prompt(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def _prompt_token_ids(self, tokenizer: Any, chat: ChatSetup) -> list[int]:
        if tokenizer is None:
            message = "messages: this model has no tokenizer or chat template (dummy weights): send token ids"
            raise FieldError(message, "messages")
        template, options = chat.template, self._template_options(tokenizer)
        if self.tools or self._tool_history:
            if chat.tools_template is None:
                message = "this model's chat template renders no tools: set api.chat_template to one that does"
                raise FieldError(f"tools: {message}", "tools")
            template = chat.tools_template
        tools = [t.model_dump(exclude_none=True) for t in self.tools or ()]
        try:
            return encode_prompt(tokenizer, self._prompt(), tools, template, options)
        except ValueError as exc:
            raise FieldError(str(exc), self.prompt_field) from None
        except (TypeError, OverflowError) as exc:  # e.g. a template variable of an unexpected type
            field = "chat_template_kwargs" if self.chat_template_kwargs else "messages"
            raise FieldError(f"{field}: the chat template failed on them: {exc}", field) from None
        except RecursionError:
            raise FieldError("messages: nested too deeply for the chat template", "messages") from None
        except TemplateError as exc:  # e.g. a template that wants user and assistant to alternate
            message = f"messages: the model's chat template refused them: {exc}"
            raise FieldError(message, "messages") from None

    def _grammar(self, chat: ChatSetup) -> dict[str, str | None]:
        """Forced calls: their JSON Schema. ``auto`` with a call format that has a trigger (and no
        ``response_format`` or reasoning, whose text could hold the trigger): its lazy grammar."""
        functions = [t.function.model_dump() for t in self.tools or ()]
        if self.forced_tools:
            named = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
            schema = check_schema(forced_schema(functions, named, self.parallel_tool_calls), "tools")
            return {"json_schema": schema, "grammar_field": "tools"}
        shape = self.answer_shape(chat)
        if shape is None or shape.parser is None or shape.reasoning is not None or self.response_format is not None:
            return _after_reasoning(super()._grammar(chat), chat.reasoning)
        lazy = shape.parser.lazy_grammar(functions)
        return {"json_schema": None, "lark_grammar": _checked_lark(lazy)} if lazy else super()._grammar(chat)

    def answer_shape(self, chat: ChatSetup) -> AnswerShape | None:
        """How this request's answer is read (None: as plain text, untouched)."""
        calls = bool(self.tools) and self.tool_choice != "none"
        if calls and not self.forced_tools and chat.tool_parser is None:
            calls = False  # no call format known: auto answers are content
        if not calls and chat.reasoning is None:
            return None
        named = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        names = [t.function.name for t in self.tools or ()]
        parser = chat.tool_parser(names) if calls and not self.forced_tools and chat.tool_parser else None
        return AnswerShape(chat.reasoning, parser, forced=calls and self.forced_tools, named=named)

    def _max_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def _num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _after_reasoning(grammar: dict[str, str | None], reasoning: ReasoningParser | None) -> dict[str, str | None]:
    """A chat's output constraint under a reasoning parser holds once the reasoning ends, as
    vLLM's: free reasoning text, then the answer under the grammar (``after_reasoning``)."""
    text, kind = grammar.get("json_schema"), "json"
    if text is None:
        text, kind = grammar.get("lark_grammar"), "lark"
    if reasoning is None or text is None:
        return grammar
    open_tag, field = None if reasoning.implicit else reasoning.open_tag, grammar.get("grammar_field")
    lark = after_reasoning((text, kind), reasoning.close_tag, open_tag, field or "response_format")
    return {"json_schema": None, "lark_grammar": lark, "grammar_field": field}


def _prompt_form(value: Any) -> str:
    """A completion prompt's form, so that a refusal speaks of the one sent: a list whose first
    item is a prompt itself is a batch, any other list token ids."""
    if isinstance(value, list):
        return "list[prompt]" if value and isinstance(value[0], (str, list)) else "list[int]"
    return "str"


CompletionPrompt = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[list[StrictInt], Tag("list[int]")]
    | Annotated[list[str | list[StrictInt]], Tag("list[prompt]")],
    Discriminator(_prompt_form),
]


class CompletionRequest(_SamplingFields):
    prompt: CompletionPrompt = Field(
        description="prompt text or token ids; a list of them is a batch: prompt i's choices are i*n .. i*n+n-1"
    )
    max_tokens: int | None = Field(
        None,
        description=f"tokens to generate (left out: {COMPLETION_MAX_TOKENS}, as OpenAI's; null: the context's rest)",
        json_schema_extra={"default": COMPLETION_MAX_TOKENS},
    )
    logprobs: int | None = Field(
        None, ge=0, le=20, description="top alternatives per output token (with echo: per prompt token too)"
    )
    echo: bool = Field(
        False,
        description="the prompt before the output, in the text and the log-probabilities (the first prompt token's "
        "is null); with max_tokens 0, the prompt alone",
    )
    add_special_tokens: bool = Field(
        True, description="a text prompt gets the tokenizer's special tokens, e.g. a BOS, as vLLM's (extension)"
    )
    best_of: int | None = None
    suffix: str | None = None

    id_prefix: ClassVar[str] = "cmpl"
    prompt_field: ClassVar[str] = "prompt"

    def _prompt(self) -> str | list[int]:
        return self.prompt

    def _special_tokens(self) -> bool:
        return self.add_special_tokens

    def batch(self) -> list[str] | list[list[int]] | None:
        """The prompts of a batched completion (two or more: a batch of one is its prompt), None for one prompt."""
        return self.prompt if _prompt_form(self.prompt) == "list[prompt]" else None

    def to_generation_requests(
        self, tokenizer: Any, limits: ContextLimits, request_id: str, chat: ChatSetup | None = None
    ) -> list[GenerationRequest]:
        """One request per prompt of a batch, ids ``<id>-<i>``; a prompt's refusal names it (``prompt.<i>``)."""
        batch = self.batch()
        if batch is None:
            return super().to_generation_requests(tokenizer, limits, request_id, chat)
        if len(batch) * self.n > MAX_BATCH_CHOICES:
            message = f"prompt: {len(batch)} prompts x n={self.n} is over {MAX_BATCH_CHOICES} choices a request"
            raise FieldError(message, "prompt")
        requests = []
        for i, prompt in enumerate(batch):
            one = self.model_copy(update={"prompt": prompt})
            try:
                requests.append(one.to_generation_request(tokenizer, limits, f"{request_id}-{i}", chat))
            except FieldError as exc:
                if exc.param != "prompt":
                    raise
                raise FieldError(f"prompt.{i}{exc.message.removeprefix('prompt')}", f"prompt.{i}") from None
        return requests

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    def _num_prompt_logprobs(self) -> int | None:
        """An echo's log-probabilities (``logprobs``) and vLLM's ``prompt_logprobs`` are scored together."""
        asked = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        return max(asked, default=None)

    def _max_tokens(self) -> tuple[str, int | None]:
        """An echo of the prompt alone (``max_tokens`` 0) generates one token, which the answer drops."""
        return "max_tokens", 1 if self.echo and self.max_tokens == 0 else self.max_tokens

    def _fewest_tokens(self) -> int:
        return 0 if self.echo else 1  # an echo may ask for the prompt alone

    def _default_max_tokens(self, limits: ContextLimits, num_prompt_tokens: int) -> int:
        """OpenAI's (and vLLM's) completions default when ``max_tokens`` is left out, within
        the room left; an explicit null asks for the rest of the context."""
        rest = super()._default_max_tokens(limits, num_prompt_tokens)
        return rest if "max_tokens" in self.model_fields_set else min(COMPLETION_MAX_TOKENS, rest)

    def _refusals(self) -> list[tuple[str, bool]]:
        return super()._refusals() + [
            ("best_of", self.best_of not in (None, 1)),
            ("suffix", bool(self.suffix)),
        ]

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        one = isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list))
        if one and _prompt_form(value[0]) != "list[prompt]":
            return value[0]  # a batch of one (lm-eval-harness sends these): that prompt
        return value


def unsupported(body: _Refusing) -> tuple[str, str] | None:
    """``(field, message)`` for the first field set to something this server does not do."""
    for name, refused in body._refusals():
        if refused:
            value = repr(getattr(body, name, None))
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


# a \uD800-\uDFFF escape in a JSON body's text: the only way a surrogate gets into one once the
# body is read as strict UTF-8 (which cannot encode them); valid pairs (an emoji) use such escapes too
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str, data: Any) -> FieldError | None:
    """The first string of a JSON body (``text``, parsed: ``data``), a key or a value, that holds
    a surrogate not in a pair (``"\\ud800"``): not Unicode text, which the tokenizer and the
    grammar library refuse with errors of their own. Names its field as validation does
    (``messages.0.content``). Looked for only when the text has such an escape."""
    if not SURROGATE_ESCAPE.search(text):
        return None
    try:
        json.dumps(data, ensure_ascii=False).encode()  # in C: a body without one passes at once
        return None
    except (UnicodeEncodeError, RecursionError):
        pass
    stack: list[tuple[tuple, Any]] = [((), data)]
    while stack:  # depth-first without recursion: json.loads admits deeper nesting than Python's stack
        path, value = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in reversed(list(items)):
            if isinstance(key, str) and (found := _LONE_SURROGATE.search(key)):
                return _surrogate_error(path, found.group(), "a key with ")
            if isinstance(item, str) and (found := _LONE_SURROGATE.search(item)):
                return _surrogate_error((*path, key), found.group())
            if isinstance(item, dict | list):
                stack.append(((*path, key), item))
    return None


def _surrogate_error(path: tuple, surrogate: str, where: str = "") -> FieldError:
    param = ".".join(map(str, path)) or None
    message = f"{where}a lone surrogate (\\u{ord(surrogate):04x}) is not valid Unicode text"
    return FieldError(f"{param or 'the body'}: {message}", param)


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
