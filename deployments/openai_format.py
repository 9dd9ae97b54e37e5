"""Engine outputs -> OpenAI response bodies and server-sent-event chunks (pure functions)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from engine.params import RequestOutput


def usage(last: RequestOutput) -> dict:
    return {
        "prompt_tokens": last.num_prompt_tokens,
        "completion_tokens": last.num_output_tokens,
        "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
    }


def finish_reason(last: RequestOutput) -> str | None:
    return last.finish_reason.value if last.finish_reason is not None else None


def full_response(kind: str, request_id: str, model: str, outputs: Sequence[RequestOutput]) -> dict:
    text = "".join(o.text for o in outputs)
    last = outputs[-1]
    if kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason(last),
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(last)}
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
    """Builds the SSE chunks of one streamed response, as OpenAI sends them."""

    def __init__(self, kind: str, request_id: str, model: str) -> None:
        self.kind, self.request_id, self.model = kind, request_id, model
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if kind == "chat" else "text_completion"

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

    def delta(self, output: RequestOutput) -> bytes | None:
        reason = finish_reason(output) if output.finished else None
        if not output.text and reason is None:
            return None
        if self.kind == "chat":
            delta = {"content": output.text} if output.text else {}
            return self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason})
        return self._chunk({"index": 0, "text": output.text, "logprobs": None, "finish_reason": reason})

    def usage(self, last: RequestOutput) -> bytes:
        return self._chunk({}, usage(last))

    @staticmethod
    def done() -> bytes:
        return sse("[DONE]")
