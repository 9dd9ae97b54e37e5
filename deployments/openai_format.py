"""Engine outputs -> OpenAI response bodies and server-sent-event chunks (pure functions).

Two endpoint formats, ``CHAT`` and ``COMPLETION`` (one ``ResponseFormat`` subclass each, so
no caller switches on a string). Log-probabilities, when the request asked for them
(``logprobs`` on completions, ``logprobs: true`` + ``top_logprobs`` on chat), take OpenAI's
two shapes: the completions object (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``) and the chat one (``content``: per token ``token``, ``logprob``, ``bytes``,
``top_logprobs``). A token's text is the tokenizer's decoding of that one id.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf

from app.tool_calls import AnswerShape, AnswerStream, Delta, Parsed
from engine.params import FinishReason, RequestOutput, TokenLogprobs

TokenText = Callable[[int], str]


def token_text_of(tokenizer) -> TokenText:
    """One id's text, each id decoded once (a prompt's log-probabilities name every token of it
    and its alternatives); ``token_id:<id>`` for a model without a tokenizer (dummy weights)."""
    if tokenizer is None:
        return lambda token_id: f"token_id:{token_id}"
    return functools.lru_cache(maxsize=1 << 18)(lambda token_id: tokenizer.decode([token_id]))


def finite(logprob: float | None) -> float | None:
    """A log-probability JSON can carry: -inf (a token the model rules out) as vLLM's -9999.0."""
    return logprob if logprob is None or math.isfinite(logprob) else -9999.0


def usage(lasts: SequenceOf[RequestOutput], per_prompt: int = 0) -> dict:
    """Usage of a request from its choices' last outputs, ``per_prompt`` choices of each prompt
    in prompt order (``n``; 0: all of one prompt): each prompt counted once (its first choice's),
    every choice's tokens."""
    firsts = lasts[:: per_prompt or len(lasts)]
    prompt = sum(o.num_prompt_tokens for o in firsts)
    completion = sum(o.num_output_tokens for o in lasts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in firsts)},
    }


def finish_reason(last: RequestOutput, called: bool = False) -> str | None:
    """``called``: the answer made tool calls, which OpenAI reports in place of a plain stop."""
    reason = last.finish_reason.value if last.finish_reason is not None else None
    return "tool_calls" if called and reason == "stop" else reason


def answer_message(reasoning: str | None, parsed: Parsed) -> dict:
    """A chat answer's message with its calls (``tool_calls``) and reasoning (``reasoning_content``)."""
    message: dict = {"role": "assistant", "content": parsed.content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if parsed.calls:
        message["tool_calls"] = [call.to_openai() for call in parsed.calls]
    return message


def answer_delta(delta: Delta) -> dict:
    """One streamed piece of a chat answer as OpenAI's ``delta``: a call's first piece carries its
    index, id, type and name; the next, its arguments."""
    if delta.kind != "call":
        return {"reasoning_content" if delta.kind == "reasoning" else "content": delta.text}
    call = delta.call.to_openai() if delta.first else {"function": {"arguments": delta.call.arguments}}
    if delta.first:
        call["function"]["arguments"] = ""
    return {"tool_calls": [{"index": delta.index, **call}]}


def chat_logprobs(entries: SequenceOf[TokenLogprobs], text_of: TokenText) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = text_of(token_id)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode())}

    return {
        "content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
    }


def completion_logprobs(entries: SequenceOf[TokenLogprobs], text_of: TokenText, offset: int = 0) -> dict:
    """``offset``: where the first token's text starts in the completion (streaming)."""
    tokens = [text_of(e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [finite(e.logprob) for e in entries],
        # the sampled token among the alternatives, as vLLM returns them; none for an echoed prompt's first token
        "top_logprobs": [
            None if e.logprob is None else {**{text_of(t): finite(lp) for t, lp in e.top}, tok: finite(e.logprob)}
            for e, tok in zip(entries, tokens)
        ],
        "text_offset": offsets,
    }


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """vLLM's ``prompt_logprobs`` of a non-streamed answer: per prompt token (null for the first,
    which nothing predicts) a map from token id to its ``logprob``, ``rank`` and ``decoded_token``,
    of the prompt's token and the ``num_top`` most likely (``ResponseFormat.add_prompt_logprobs``
    puts them in the body)."""

    num_top: int
    text_of: TokenText

    def of(self, first: RequestOutput) -> list[dict | None]:
        """The list of a choice's prompt, from its first output (``RequestOutput.prompt_logprobs``)."""
        return [None, *map(self._entry, first.prompt_logprobs or ())]

    def _entry(self, scored: TokenLogprobs) -> dict:
        ranked = {scored.token_id: (scored.logprob, scored.rank)}
        ranked.update((token, (logprob, rank)) for rank, (token, logprob) in enumerate(scored.top[: self.num_top], 1))
        return {
            str(token): {"logprob": finite(logprob), "rank": rank, "decoded_token": self.text_of(token)}
            for token, (logprob, rank) in ranked.items()
        }


ENDED = (FinishReason.STOP, FinishReason.LENGTH)  # a normal end (not aborted, no error)


@dataclasses.dataclass
class Echo:
    """A completion's ``echo``: each choice's first output starts with its prompt, the text and,
    with ``num_top`` (``logprobs`` asked), its tokens' log-probabilities (that many alternatives),
    the first token's null as OpenAI's. ``prompt_only`` (``max_tokens`` 0): the prompt alone, the
    one token the engine generated dropped. ``texts``, ``first_tokens``: per prompt; choice i is
    prompt ``i // per_prompt``'s."""

    texts: SequenceOf[str]
    first_tokens: SequenceOf[int]
    per_prompt: int
    prompt_only: bool = False
    num_top: int | None = None
    _started: set[int] = dataclasses.field(default_factory=set)

    def __call__(self, index: int, output: RequestOutput) -> RequestOutput:
        if index in self._started:
            return output
        self._started.add(index)
        prompt = index // self.per_prompt
        head = ()
        if output.prompt_logprobs is not None and self.num_top is not None:  # scored with vLLM's prompt_logprobs' top
            scored = (dataclasses.replace(e, top=e.top[: self.num_top], rank=None) for e in output.prompt_logprobs)
            head = (TokenLogprobs(self.first_tokens[prompt], None, ()), *scored)
        if self.prompt_only:
            return dataclasses.replace(
                output, token_ids=(), text=self.texts[prompt], logprobs=head, num_output_tokens=0,
                finish_reason=FinishReason.LENGTH if output.finish_reason in ENDED else output.finish_reason,
            )  # fmt: skip
        return dataclasses.replace(output, text=self.texts[prompt] + output.text, logprobs=(*head, *output.logprobs))


class ResponseFormat(ABC):
    """How one endpoint shapes its choices; the envelope (id, created, model, usage) is shared."""

    object_name: str  # the non-streamed body's ``object``
    chunk_object_name: str  # each streamed chunk's ``object``

    @abstractmethod
    def choice(self, text: str, logprobs: dict | None, reason: str | None, index: int = 0) -> dict:
        """A choice of a non-streamed body."""

    @abstractmethod
    def delta_choice(self, text: str, logprobs: dict | None, reason: str | None, index: int = 0) -> dict:
        """The choice of one streamed chunk."""

    @abstractmethod
    def logprobs(self, entries: SequenceOf[TokenLogprobs], text_of: TokenText, offset: int) -> tuple[dict, int]:
        """The ``logprobs`` object of ``entries`` and the offset after them (``offset``: characters
        of token text sent before them; only completions count it)."""

    def first_chunk(self, index: int = 0) -> dict | None:
        """A choice sent before any token (chat announces the assistant's role), or None."""
        return None

    def writers(
        self, body, request_id: str, model: str, choices: SequenceOf, text_of: TokenText | None, shape
    ) -> list[ChunkWriter]:
        """The chunk writers of a streamed request ``body``, one per choice (its engine request in ``choices``)."""
        options = body.stream_options  # vLLM's continuous_usage_stats: each chunk carries its choice's usage so far
        counted = bool(options and options.include_usage and options.continuous_usage_stats)
        return [
            ChunkWriter(self, request_id, model, text_of, i, shape, len(c.prompt_token_ids) if counted else None)
            for i, c in enumerate(choices)
        ]

    def full(
        self, body, request_id: str, model: str, outputs: SequenceOf, text_of: TokenText | None, shape, scored=None
    ) -> dict:
        """The non-streamed body of a request ``body``'s choices (``full_response_choices``)."""
        return full_response_choices(self, request_id, model, outputs, text_of, shape, body.n, scored)

    def add_prompt_logprobs(self, body: dict, scored: PromptLogprobs, choices: SequenceOf[SequenceOf]) -> None:
        """vLLM's ``prompt_logprobs`` in a non-streamed ``body``: each choice's, of its own prompt."""
        for choice, outputs in zip(body["choices"], choices):
            choice["prompt_logprobs"] = scored.of(outputs[0])


class ChatFormat(ResponseFormat):
    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def choice(self, text: str, logprobs: dict | None, reason: str | None, index: int = 0) -> dict:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def delta_choice(self, text: str, logprobs: dict | None, reason: str | None, index: int = 0) -> dict:
        delta = {"content": text} if text else {}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def logprobs(self, entries: SequenceOf[TokenLogprobs], text_of: TokenText, offset: int) -> tuple[dict, int]:
        return chat_logprobs(entries, text_of), offset

    def first_chunk(self, index: int = 0) -> dict | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def add_prompt_logprobs(self, body: dict, scored: PromptLogprobs, choices: SequenceOf[SequenceOf]) -> None:
        body["prompt_logprobs"] = scored.of(choices[0][0])  # once: the choices share the prompt


class CompletionFormat(ResponseFormat):
    object_name = chunk_object_name = "text_completion"

    def choice(self, text: str, logprobs: dict | None, reason: str | None, index: int = 0) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    delta_choice = choice

    def logprobs(self, entries: SequenceOf[TokenLogprobs], text_of: TokenText, offset: int) -> tuple[dict, int]:
        body = completion_logprobs(entries, text_of, offset)
        return body, offset + sum(len(token) for token in body["tokens"])


CHAT, COMPLETION = ChatFormat(), CompletionFormat()


def full_response(
    fmt: ResponseFormat,
    request_id: str,
    model: str,
    outputs: SequenceOf[RequestOutput],
    text_of: TokenText | None = None,
) -> dict:
    """The non-streamed body; ``text_of`` set when the request asked for log-probabilities."""
    return full_response_choices(fmt, request_id, model, [outputs], text_of)


def full_response_choices(
    fmt: ResponseFormat,
    request_id: str,
    model: str,
    choices: SequenceOf[SequenceOf[RequestOutput]],
    text_of: TokenText | None = None,
    shape: AnswerShape | None = None,
    per_prompt: int = 0,
    scored: PromptLogprobs | None = None,
) -> dict:
    """The non-streamed body of the choices (each choice's outputs, in index order; ``per_prompt``
    of each prompt); ``shape``: how a chat answer's reasoning and tool calls are read (None: its
    text as it is); ``scored``: with vLLM's ``prompt_logprobs``."""
    bodies = []
    for index, outputs in enumerate(choices):
        entries = [e for o in outputs for e in o.logprobs]
        logprobs = fmt.logprobs(entries, text_of, 0)[0] if text_of else None
        text = "".join(o.text for o in outputs)
        if shape is None:
            bodies.append(fmt.choice(text, logprobs, finish_reason(outputs[-1]), index))
            continue
        reasoning, parsed = shape.read(text)
        reason = finish_reason(outputs[-1], called=bool(parsed.calls))
        message = answer_message(reasoning, parsed)
        bodies.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason})
    body = {
        "id": request_id,
        "object": fmt.object_name,
        "created": int(time.time()),
        "model": model,
        "choices": bodies,
        "usage": usage([outputs[-1] for outputs in choices], per_prompt),
    }
    if scored is not None:
        fmt.add_prompt_logprobs(body, scored, choices)
    return body


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class ChunkWriter:
    """Builds the SSE chunks of one streamed response, as OpenAI sends them. With ``text_of``
    each chunk carries the log-probabilities of its tokens (those of tokens whose text is
    held back, e.g. part of a character, ride on the next chunk)."""

    def __init__(
        self,
        fmt: ResponseFormat,
        request_id: str,
        model: str,
        text_of: TokenText | None = None,
        index: int = 0,
        shape: AnswerShape | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        """``index``: the choice this writer's chunks carry (``n`` > 1: one writer per choice);
        ``shape``: how a chat answer's reasoning and tool calls are read (None: text as it comes);
        ``prompt_tokens``: the choice's prompt length, when each chunk carries the usage so far
        (vLLM's ``continuous_usage_stats``)."""
        self.fmt, self.request_id, self.model, self.index = fmt, request_id, model, index
        self.prompt_tokens, self._completion_tokens = prompt_tokens, 0
        self.created = int(time.time())
        self.text_of = text_of
        self.answer = AnswerStream(shape) if shape is not None else None
        self._pending: list[TokenLogprobs] = []
        self._offset = 0  # characters of text sent so far (completions' text_offset)

    def _chunk(self, choice: dict | None, usage_body: dict | None = None) -> bytes:
        body = {
            "id": self.request_id,
            "object": self.fmt.chunk_object_name,
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice else [],
        }
        if usage_body is None and choice and self.prompt_tokens is not None:
            usage_body = {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self._completion_tokens,
                "total_tokens": self.prompt_tokens + self._completion_tokens,
            }
        if usage_body is not None:
            body["usage"] = usage_body
        return sse(body)

    def start(self) -> bytes | None:
        first = self.fmt.first_chunk(self.index)
        return None if first is None else self._chunk(first)

    def error(self, body: dict) -> bytes:
        """A failure after the first chunk: its error body, as vLLM sends it."""
        return sse(body)

    def _logprobs(self) -> dict | None:
        if self.text_of is None:
            return None
        entries, self._pending = self._pending, []
        body, self._offset = self.fmt.logprobs(entries, self.text_of, self._offset)
        return body

    def delta(self, output: RequestOutput) -> bytes | None:
        self._pending.extend(output.logprobs)
        self._completion_tokens = output.num_output_tokens
        if self.answer is not None:
            return self._answer_delta(output)
        reason = finish_reason(output) if output.finished else None
        if not output.text and reason is None:
            return None
        return self._chunk(self.fmt.delta_choice(output.text, self._logprobs(), reason, self.index))

    def _answer_delta(self, output: RequestOutput) -> bytes | None:
        """The chunks of one output of a read answer: a chunk per piece (content, reasoning, a
        call's start or arguments), the finish reason on the last."""
        pieces = [answer_delta(d) for d in self.answer.feed(output.text, final=output.finished)]
        reason = finish_reason(output, called=self.answer.num_calls > 0) if output.finished else None
        if not pieces and reason is None:
            return None
        chunks, logprobs = [], self._logprobs()
        for i, delta in enumerate(pieces or [{}]):
            last = i == max(len(pieces), 1) - 1
            choice = {"index": self.index, "delta": delta, "logprobs": logprobs if i == 0 else None}
            chunks.append(self._chunk(choice | {"finish_reason": reason if last else None}))
        return b"".join(chunks)

    def usage(self, lasts: SequenceOf[RequestOutput], per_prompt: int = 0) -> bytes:
        return self._chunk(None, usage(lasts, per_prompt))

    @staticmethod
    def done() -> bytes:
        return sse("[DONE]")
