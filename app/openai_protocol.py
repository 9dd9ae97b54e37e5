"""OpenAI-compatible request bodies and error bodies (validated once, at the edge)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="send a final chunk with token usage")


class _SamplingFields(_Body):
    model: str = Field(description="model name from GET /v1/models")
    max_tokens: int | None = Field(None, description="tokens to generate (default: the rest of the context)")
    temperature: float = Field(1.0, description="0 is greedy")
    top_p: float = Field(1.0, description="nucleus sampling mass, in (0, 1]")
    top_k: int | None = Field(None, description="sample among the k most likely tokens (extension)")
    seed: int | None = Field(None, description="per-request seed for reproducible sampling")
    stop: str | list[str] | None = Field(None, description="stop strings")
    stream: bool = Field(False, description="stream server-sent events")
    stream_options: StreamOptions | None = Field(None, description="streaming options")
    n: int = Field(1, description="only 1 is supported")
    ignore_eos: bool = Field(False, description="keep generating past end-of-sequence (extension)")
    min_tokens: int = Field(0, description="no EOS or stop token ids before this many tokens (extension)")


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"] = Field(description="author of the message")
    content: str = Field(description="message text")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far")
    max_completion_tokens: int | None = Field(None, description="alias of max_tokens")


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] = Field(description="prompt text or token ids")


def error_body(message: str, param: str | None, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_error_body(exc: ValidationError) -> dict:
    """The first problem, naming the field as OpenAI does (``param``)."""
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    return error_body(f"{param}: {first['msg']}" if param else first["msg"], param)
