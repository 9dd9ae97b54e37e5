"""OpenAI's Responses API (``POST /v1/responses``): the request, read as the chat completion it
asks for (``ResponsesRequest.chat_request``), so that one engine path, one chat template and one
set of checks serve both. What differs is named in the client's terms: an error about the chat's
``max_tokens`` is one about ``max_output_tokens``, ``messages.3`` is the input item it came from.

Served: ``input`` as text or items (messages of text parts; ``function_call`` and
``function_call_output`` items, the history of a tool loop; earlier ``reasoning`` items, which the
chat template leaves out as it does a chat's past reasoning), ``instructions``, function
``tools`` and ``tool_choice``, ``text.format`` (JSON object or schema), ``max_output_tokens``,
``temperature``, ``top_p``, ``metadata`` (returned as sent), streaming, and vLLM's sampling
extensions of the same names as on chat. Responses are not stored, as vLLM's by default:
``store`` is accepted and answered ``false``; what needs a stored response
(``previous_response_id``, ``background``) is refused by name, as are the settings this server
does not do (``RESPONSES_NOT_IMPLEMENTED``); hints that change no answer (``prompt_cache_key``,
``service_tier``, ``safety_identifier``) are ignored, as any field a chat does not know.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from app.openai_protocol import (
    NOT_IMPLEMENTED,
    ChatCompletionRequest,
    ChatSetup,
    FunctionCall,
    _Body,
    _GenerationBody,
    unsupported,
    validation_error_body,
)
from app.tool_calls import AnswerShape
from engine.params import ContextLimits, FieldError, GenerationRequest

# fields of OpenAI's that this server does not do, with their neutral values (refused when set otherwise)
RESPONSES_NOT_IMPLEMENTED: dict[str, Any] = {
    "previous_response_id": None,  # nothing is stored
    "conversation": None,
    "background": False,
    "prompt": None,  # OpenAI's stored prompt templates
    # nothing is encrypted: a reasoning item comes whole (and one sent back is left out)
    "include": (None, [], ["reasoning.encrypted_content"]),
    "echo": False,  # chat's and vLLM's, not the Responses API's
    "n": 1,
    "prompt_logprobs": None,
    "top_logprobs": (None, 0),
    "truncation": ("disabled", None),
    "max_tool_calls": None,
    "context_management": None,  # server-side compaction
    "reasoning": None,  # an effort or summary setting (an answer's reasoning is returned as written)
}
# vLLM's sampling extensions, taken as chat takes them (the same names, the same checks)
SAMPLING_EXTENSIONS = (
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "bad_words",
    "allowed_token_ids",
    "chat_template_kwargs",
    *NOT_IMPLEMENTED,  # refused by chat by name
)
# a chat field's name -> the Responses field it comes from
CHAT_FIELDS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


def _field_error(exc: ValidationError) -> FieldError:
    """A schema's refusal as ``validation_error_body`` words it (the field meant, of a union's)."""
    error = validation_error_body(exc)["error"]
    return FieldError(error["message"], error["param"])


class FunctionTool(_Body):
    type: Literal["function"] = Field(description="only functions (no hosted tools)")
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$", description="the function's name")
    description: str | None = Field(None, description="what it does, for the model")
    parameters: dict[str, Any] | None = Field(None, description="its arguments, a JSON Schema")
    strict: bool | None = Field(None, description="accepted: forced calls always follow the schema")

    def for_chat(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class FunctionChoice(_Body):
    type: Literal["function"] = Field(description="only functions")
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = Field(description="text (no constraint) or JSON")
    name: str | None = Field(None, description="the schema's name (json_schema)")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON Schema (json_schema)")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("schema is required when type is 'json_schema'")
        return self

    def for_chat(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name or "response", "schema": self.schema_, "strict": self.strict}
        return {"type": "json_schema", "json_schema": schema}


class TextConfig(_Body):
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"), description="the output's format")
    verbosity: Literal["medium"] | None = Field(None, description="only the default")


class TextPart(_Body):
    type: Literal["input_text", "output_text"] = Field(description="text only (no images, files or audio)")
    text: str


def _for_chat(content: str | list[TextPart]) -> str | list[dict[str, str]]:
    """Text, or text parts as chat's (which the template joins as it joins a chat's)."""
    return content if isinstance(content, str) else [{"type": "text", "text": part.text} for part in content]


class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str = Field(description="JSON text of an object")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        return FunctionCall._json_object(value)


class FunctionCallOutput(_Body):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]


ITEMS = {"message": InputMessage, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutput}


class ResponsesRequest(_GenerationBody):
    not_implemented: ClassVar[dict[str, Any]] = RESPONSES_NOT_IMPLEMENTED
    id_prefix: ClassVar[str] = "resp"
    # what the ingress reads of a generation body: one choice, no usage chunks, no prompt scores, no echo
    n: ClassVar[int] = 1
    stream_options: ClassVar[None] = None
    prompt_logprobs: ClassVar[None] = None
    echo: ClassVar[bool] = False

    model: str = Field(description="model name from GET /v1/models")
    input: str | list[dict[str, Any]] = Field(
        description="text, or items: messages (text parts), function_call and function_call_output items"
    )
    instructions: str | None = Field(None, description="a system message before the input")
    max_output_tokens: int | None = Field(None, description="tokens to generate (default: the rest of the context)")
    temperature: float = Field(1.0, description="below 1e-5 (0 included) is greedy")
    top_p: float = Field(1.0, description="nucleus sampling mass, in (0, 1]")
    stream: bool = Field(False, description="stream the response's events")
    tools: list[FunctionTool] | None = Field(None, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = Field(
        None, description="none, auto (the default with tools), required, or one named function"
    )
    parallel_tool_calls: bool = Field(True, description="more than one call in an answer")
    text: TextConfig = Field(default_factory=TextConfig, description="the output's format")
    store: bool = Field(True, description="accepted; responses are not stored (answered false)")
    metadata: dict[str, str] | None = Field(None, description="returned as sent")
    user: str | None = Field(None, description="accepted, not used")
    _chat: ChatCompletionRequest | None = PrivateAttr(None)
    _origins: list[str] = PrivateAttr(default_factory=list)

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list) -> str | list:
        if isinstance(value, list) and not value:
            raise ValueError("List should have at least 1 item")
        return value

    # ---- the chat completion it asks for ---------------------------------------------------

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion this response is (built once); a ``FieldError`` names the client's field."""
        if self._chat is None:
            messages = self._messages()
            try:
                chat = ChatCompletionRequest.model_validate(self._chat_fields(messages))
            except ValidationError as exc:
                raise self._renamed(_field_error(exc)) from None
            if (problem := unsupported(chat)) is not None:  # one of vLLM's fields that chat refuses
                raise FieldError(problem[1], problem[0])
            self._chat = chat
        return self._chat

    def _chat_fields(self, messages: list[dict]) -> dict[str, Any]:
        extra = self.model_extra or {}
        fields = {name: extra[name] for name in SAMPLING_EXTENSIONS if name in extra}
        fields |= {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self.text.format.for_chat(),
        }
        if self.tools:
            fields["tools"] = [tool.for_chat() for tool in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        return fields

    def _messages(self) -> list[dict[str, Any]]:
        """The chat's messages; ``_origins[k]``: the field message k comes from."""
        messages, self._origins = [], []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
            self._origins.append("instructions")
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for i, data in enumerate(items):
            where = "input" if isinstance(self.input, str) else f"input.{i}"
            item = self._item(data, where)
            if item is None:
                continue
            if isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                if messages and messages[-1]["role"] == "assistant" and self._origins[-1].startswith("input"):
                    messages[-1].setdefault("tool_calls", []).append(call)  # one turn's calls: one message
                    continue
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutput):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _for_chat(item.output)})
            else:
                messages.append({"role": item.role, "content": _for_chat(item.content)})
            self._origins.append(where)
        if not messages or all(origin == "instructions" for origin in self._origins):
            raise FieldError("input: no message to answer (only earlier reasoning)", "input")
        return messages

    @staticmethod
    def _item(data: Any, where: str) -> InputMessage | FunctionCallItem | FunctionCallOutput | None:
        """One input item, checked (None: an earlier reasoning item, which the template leaves out)."""
        kind = data.get("type") or "message"
        if kind == "reasoning":
            return None
        if kind not in ITEMS:
            message = f"{kind!r} items are not supported (messages, function_call, function_call_output)"
            raise FieldError(f"{where}: {message}", where)
        try:
            return ITEMS[kind].model_validate(data)
        except ValidationError as exc:
            error = _field_error(exc)
            field = ".".join(p for p in (where, error.param) if p)
            raise FieldError(f"{field}{str(error).removeprefix(error.param or '')}", field) from None

    def _renamed(self, error: FieldError) -> FieldError:
        """A chat field's error as one about the Responses field it came from."""
        param, text = error.param, str(error)
        if not param:
            return error
        head, _, rest = param.partition(".")
        if head == "messages" and rest:
            index, _, tail = rest.partition(".")
            origin = self._origins[int(index)] if index.isdigit() and int(index) < len(self._origins) else "input"
            new = ".".join(p for p in (origin, tail.replace("tool_call_id", "call_id")) if p)
        elif head == "tools":
            new = param.replace(".function.", ".", 1)
        else:
            new = ".".join(p for p in (CHAT_FIELDS.get(head, head), rest) if p)
        text = f"{new}{text.removeprefix(param)}" if text.startswith(param) else f"{new}: {text}"
        return FieldError(re.sub(r"\bmax_tokens\b", "max_output_tokens", text), new)

    # ---- what the ingress asks of a generation body ----------------------------------------

    def to_generation_requests(
        self, tokenizer: Any, limits: ContextLimits, request_id: str, chat: ChatSetup | None = None
    ) -> list[GenerationRequest]:
        chat_request = self.chat_request()
        try:
            return chat_request.to_generation_requests(tokenizer, limits, request_id, chat)
        except FieldError as exc:
            raise self._renamed(exc) from None

    def answer_shape(self, chat: ChatSetup) -> AnswerShape | None:
        """How the answer is read into output items (reasoning, message, function calls; None: a
        message of the text as it is)."""
        return self.chat_request().answer_shape(chat)

    def echoed(self) -> dict[str, Any]:
        """The request's settings as a response body repeats them."""
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": self.temperature,
            "text": self.text.model_dump(by_alias=True, exclude_none=True),
            "tool_choice": self.tool_choice.model_dump() if isinstance(self.tool_choice, FunctionChoice)
            else self.tool_choice or ("auto" if self.tools else "none"),
            "tools": [tool.model_dump(exclude_none=True) for tool in self.tools or ()],
            "top_p": self.top_p,
            "truncation": "disabled",
            "user": self.user,
        }  # fmt: skip
