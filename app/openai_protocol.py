"""OpenAI-compatible request bodies and error bodies (validated once, at the edge).

Fields OpenAI defines that this server does not implement are declared, so that a request
setting one to anything but its neutral value is refused naming it (``unsupported``)
instead of being silently ignored; unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator

from engine.params import SEED_RANGE


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
    n: int = Field(1, description="only 1 is supported")
    ignore_eos: bool = Field(False, description="keep generating past end-of-sequence (extension)")
    min_tokens: int = Field(0, description="no EOS or stop token ids before this many tokens (extension)")
    user: str | None = Field(None, description="accepted, not used")
    # declared so that setting them is refused by name (see ``unsupported``)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None


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
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[StrictInt] = Field(description="prompt text or token ids")
    logprobs: int | None = Field(None, ge=0, le=20, description="top alternatives per output token")
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

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
    checks: list[tuple[str, bool]] = [
        ("n", body.n != 1),
        ("presence_penalty", body.presence_penalty != 0),
        ("frequency_penalty", body.frequency_penalty != 0),
        ("logit_bias", bool(body.logit_bias)),
    ]
    if isinstance(body, ChatCompletionRequest):
        checks += [
            ("response_format", (body.response_format or {}).get("type", "text") != "text"),
            ("tools", bool(body.tools)),
            ("tool_choice", body.tool_choice not in (None, "none")),
        ]
    if isinstance(body, CompletionRequest):
        checks += [
            ("echo", body.echo),
            ("best_of", body.best_of not in (None, 1)),
            ("suffix", bool(body.suffix)),
        ]
    for name, refused in checks:
        if refused:
            value = repr(getattr(body, name))
            return name, f"{name}: {value if len(value) <= 60 else value[:57] + '...'} is not supported by this server"
    return None


def error_body(message: str, param: str | None, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


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
