"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` bodies.

``/tokenize`` gives a prompt's token ids exactly as the generation endpoints make them: a
completion's text (``prompt``, with the tokenizer's special tokens unless
``add_special_tokens`` is false) or a chat (``messages`` through the chat template, with the
same template fields and checks as ``/v1/chat/completions``). ``/detokenize`` gives the text
of token ids (special tokens kept, as vLLM's). ``model`` may be left out; when set it must be
the served model's name.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

from pydantic import Field, StrictInt

from app.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatSetup,
    CompletionRequest,
    Tool,
    _Body,
    _Refusing,
    unsupported,
)
from engine.params import ContextLimits, FieldError

# the chat fields a tokenize body shares with a chat completion's, which tokenizes them
CHAT_FIELDS = ("messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")


class _TokenizeFields(_Refusing):
    # unknown fields ignored, as vLLM does; vLLM's fields not implemented here are refused by name

    model: str | None = Field(None, description="the served model's name, if given (GET /v1/models)")
    return_token_strs: bool = Field(False, description="also return each token's string (the tokenizer's pieces)")

    def token_ids(self, tokenizer: Any, chat: ChatSetup) -> list[int]:
        """The prompt's token ids, as the generation endpoint would make them (``FieldError``
        naming the client's field)."""
        if (problem := unsupported(self)) is not None:
            raise FieldError(problem[1], problem[0])
        return self._as_generation_request().prompt_token_ids(tokenizer, chat)

    @abstractmethod
    def _as_generation_request(self) -> CompletionRequest | ChatCompletionRequest:
        """The generation request whose prompt this body asks about (its other fields the defaults)."""


class TokenizeCompletionRequest(_TokenizeFields):
    prompt: str = Field(description="the text, as a completion's prompt")
    add_special_tokens: bool = Field(True, description="the tokenizer's special tokens, e.g. a BOS (as a completion)")

    def token_ids(self, tokenizer: Any, chat: ChatSetup) -> list[int]:
        if self.prompt or tokenizer is None:
            return super().token_ids(tokenizer, chat)
        return list(tokenizer("", add_special_tokens=self.add_special_tokens)["input_ids"])  # vLLM's: [] or a BOS

    def _as_generation_request(self) -> CompletionRequest:
        fields = {"prompt": self.prompt, "add_special_tokens": self.add_special_tokens}
        return CompletionRequest.model_construct(model=self.model or "", **fields)


class TokenizeChatRequest(_TokenizeFields):
    not_implemented: ClassVar[dict[str, Any]] = {"chat_template": None, "mm_processor_kwargs": None}

    messages: list[ChatMessage] = Field(min_length=1, description="the conversation, as a chat completion's")
    tools: list[Tool] | None = Field(None, description="functions the template writes into the prompt")
    add_generation_prompt: bool = Field(True, description="end the prompt with the assistant's turn")
    continue_final_message: bool = Field(False, description="continue the last message, an assistant's")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="variables for the chat template")
    add_special_tokens: bool = Field(False, description="must stay false: the template writes them")

    def _as_generation_request(self) -> ChatCompletionRequest:
        if self.add_special_tokens:
            message = "add_special_tokens: True is not supported by this server (the chat template writes them)"
            raise FieldError(message, "add_special_tokens")
        fields = {name: getattr(self, name) for name in CHAT_FIELDS}
        return ChatCompletionRequest.model_construct(model=self.model or "", **fields)


class DetokenizeRequest(_Body):
    model: str | None = Field(None, description="the served model's name, if given (GET /v1/models)")
    tokens: list[StrictInt] = Field(description="token ids of the model's vocabulary, at most max_model_len")

    def text(self, tokenizer: Any, limits: ContextLimits) -> str:
        """The tokens' text (``FieldError`` naming the first id out of the vocabulary); at most
        ``max_model_len`` of them."""
        if tokenizer is None:
            raise FieldError("tokens: this model has no tokenizer (dummy weights)", "tokens")
        if len(self.tokens) > limits.max_model_len:
            message = (
                f"tokens: {len(self.tokens)} ids, more than a context holds (max_model_len {limits.max_model_len})"
            )
            raise FieldError(message, "tokens")
        vocab_size = limits.vocab_size
        for i, token in enumerate(self.tokens):
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                message = f"tokens.{i}: token id {token} is out of vocabulary (the model has {vocab_size} ids)"
                raise FieldError(message, f"tokens.{i}")
        return tokenizer.decode(self.tokens)


def tokenize_schema(data: dict[str, Any]) -> type[TokenizeChatRequest] | type[TokenizeCompletionRequest]:
    """The body's form, as vLLM tells them apart: a chat has ``messages``."""
    return TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
