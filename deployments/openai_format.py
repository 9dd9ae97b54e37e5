"""Engine outputs -> OpenAI response bodies and server-sent-event chunks (pure functions).

Log-probabilities, when the request asked for them (``logprobs`` on completions,
``logprobs: true`` + ``top_logprobs`` on chat), take OpenAI's two shapes: the completions
object (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``) and the chat one
(``content``: per token ``token``, ``logprob``, ``bytes``, ``top_logprobs``). A token's
text is the tokenizer's decoding of that one id.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence

from engine.params import RequestOutput, TokenLogprobs

TokenText = Callable[[int], str]


def token_text_of(tokenizer) -> TokenText:
    """One id's text; ``token_id:<id>`` for a model without a tokenizer (dummy weights)."""
    if tokenizer is None:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id])


def usage(last: RequestOutput) -> dict:
    return {
        "prompt_tokens": last.num_prompt_tokens,
        "completion_tokens": last.num_output_tokens,
        "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
    }


def finish_reason(last: RequestOutput) -> str | None:
    return last.finish_reason.value if last.finish_reason is not None else None


def chat_logprobs(entries: Sequence[TokenLogprobs], text_of: TokenText) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = text_of(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
    }


def completion_logprobs(entries: Sequence[TokenLogprobs], text_of: TokenText, offset: int = 0) -> dict:
    """``offset``: where the first token's text starts in the completion (streaming)."""
    tokens = [text_of(e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        # the sampled token among the alternatives, as vLLM returns them
        "top_logprobs": [{**{text_of(t): lp for t, lp in e.top}, tok: e.logprob} for e, tok in zip(entries, tokens)],
        "text_offset": offsets,
    }


def full_response(
    kind: str, request_id: str, model: str, outputs: Sequence[RequestOutput], text_of: TokenText | None = None
) -> dict:
    """The non-streamed body; ``text_of`` set when the request asked for log-probabilities."""
    text = "".join(o.text for o in outputs)
    last = outputs[-1]
    entries = [e for o in outputs for e in o.logprobs]
    if kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": chat_logprobs(entries, text_of) if text_of else None,
            "finish_reason": finish_reason(last),
        }
        obj = "chat.completion"
    else:
        logprobs = completion_logprobs(entries, text_of) if text_of else None
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(last)}
        obj = "text_completion"
    return {
        "id": request_id,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(last),
    }


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class ChunkWriter:
    """Builds the SSE chunks of one streamed response, as OpenAI sends them. With ``text_of``
    each chunk carries the log-probabilities of its tokens (those of tokens whose text is
    held back, e.g. part of a character, ride on the next chunk)."""

    def __init__(self, kind: str, request_id: str, model: str, text_of: TokenText | None = None) -> None:
        self.kind, self.request_id, self.model = kind, request_id, model
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self.text_of = text_of
        self._pending: list[TokenLogprobs] = []
        self._offset = 0  # completions: characters of token text sent so far

    def _chunk(self, choice: dict, usage_body: dict | None = None) -> bytes:
        body = {
            "id": self.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice else [],
        }
        if usage_body is not None:
            body["usage"] = usage_body
        return sse(body)

    def start(self) -> bytes | None:
        if self.kind != "chat":
            return None
        return self._chunk(
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        )

    def _logprobs(self) -> dict | None:
        if self.text_of is None:
            return None
        entries, self._pending = self._pending, []
        if self.kind == "chat":
            return chat_logprobs(entries, self.text_of)
        body = completion_logprobs(entries, self.text_of, self._offset)
        self._offset += sum(len(t) for t in body["tokens"])
        return body

    def delta(self, output: RequestOutput) -> bytes | None:
        self._pending.extend(output.logprobs)
        reason = finish_reason(output) if output.finished else None
        if not output.text and reason is None:
            return None
        if self.kind == "chat":
            delta = {"content": output.text} if output.text else {}
            return self._chunk({"index": 0, "delta": delta, "logprobs": self._logprobs(), "finish_reason": reason})
        return self._chunk({"index": 0, "text": output.text, "logprobs": self._logprobs(), "finish_reason": reason})

    def usage(self, last: RequestOutput) -> bytes:
        return self._chunk({}, usage(last))

    @staticmethod
    def done() -> bytes:
        return sse("[DONE]")
