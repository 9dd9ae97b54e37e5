"""Engine outputs -> OpenAI Responses API bodies and their streamed events (``POST /v1/responses``).

An answer becomes output items, in order: its reasoning (``reasoning``, when the server's reasoning
parser finds some), its text (a ``message`` of one ``output_text`` part; there is one unless the
answer is only calls), its calls (``function_call``, one per call). A response ended by
``max_output_tokens`` is ``incomplete``; one the engine could not finish, ``failed``. Streamed,
each item is announced (``output_item.added``), its text or arguments sent in deltas, then closed
(``output_item.done``); the last event is ``response.completed`` (``.incomplete``, ``.failed``)
with the whole response. Events are ``event:`` and ``data:`` lines, as OpenAI's, with no
``[DONE]`` after them. (Text a model writes after its calls, which the unstreamed body joins to
the text before them, streams as a second message: the first is closed by then.)
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf

from app.responses_protocol import ResponsesRequest
from app.tool_calls import AnswerShape, AnswerStream, Delta, Parsed, ToolCall
from engine.params import FinishReason, RequestOutput

CountTokens = Callable[[str], int]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _part(kind: str, text: str) -> dict:
    """A content part: ``output_text`` (a message's, with OpenAI's empty annotations) or ``reasoning_text``."""
    return {"type": kind, "text": text, **({"annotations": [], "logprobs": []} if kind == "output_text" else {})}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [_part("reasoning_text", text)]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [_part("output_text", text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def status_of(last: RequestOutput) -> tuple[str, dict | None, dict | None]:
    """The response's ``status``, ``incomplete_details`` and ``error`` from how the answer ended
    (``failed``: the engine could not finish it, e.g. a grammar that refused every token)."""
    if last.finish_reason == FinishReason.LENGTH:
        return "incomplete", {"reason": "max_output_tokens"}, None
    if last.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
        return (
            "failed",
            None,
            {"code": "server_error", "message": last.error or f"the answer ended: {last.finish_reason}"},
        )
    return "completed", None, None


def item_status(status: str) -> str:
    """The status of the item an answer ended in (an item is completed or incomplete)."""
    return "completed" if status == "completed" else "incomplete"


class ResponsesFormat:
    """The Responses API's non-streamed body and its event writer (the ingress asks these of the
    format of the endpoint it serves). ``count_tokens``: a text's tokens (the usage's reasoning
    tokens: those of the reasoning text)."""

    def __init__(self, count_tokens: CountTokens) -> None:
        self.count_tokens = count_tokens

    def envelope(self, body: ResponsesRequest, response_id: str, model: str, created: int) -> dict:
        """A response of no output yet, ``in_progress``."""
        return {
            "id": response_id,
            "object": "response",
            "created_at": created,
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "model": model,
            "output": [],
            "usage": None,
            **body.echoed(),
        }

    def usage(self, last: RequestOutput, output: SequenceOf[dict]) -> dict:
        reasoning = "".join(p["text"] for item in output if item["type"] == "reasoning" for p in item["content"])
        return {
            "input_tokens": last.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": last.num_cached_tokens},
            "output_tokens": last.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.count_tokens(reasoning) if reasoning else 0},
            "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
        }

    def finished(self, response: dict, last: RequestOutput, output: list[dict]) -> dict:
        status, incomplete, error = status_of(last)
        usage = self.usage(last, output)
        return response | {"status": status, "incomplete_details": incomplete, "error": error, "output": output,
                           "usage": usage}  # fmt: skip

    def full(
        self, body: ResponsesRequest, request_id: str, model: str, outputs: SequenceOf, text_of, shape, scored=None
    ) -> dict:
        """The non-streamed body of the one choice's outputs (``outputs[0]``; the last item
        ``incomplete`` when the answer ran out of ``max_output_tokens`` in it)."""
        text, last = "".join(o.text for o in outputs[0]), outputs[0][-1]
        reasoning, parsed = shape.read(text) if shape is not None else (None, Parsed(text))
        output = [reasoning_item(_id("rs"), reasoning)] if reasoning is not None else []
        if parsed.content is not None or not parsed.calls:
            output.append(message_item(_id("msg"), parsed.content or ""))
        output += [call_item(_id("fc"), call) for call in parsed.calls]
        output[-1]["status"] = item_status(status_of(last)[0])
        return self.finished(self.envelope(body, request_id, model, int(time.time())), last, output)

    def writers(
        self, body: ResponsesRequest, request_id: str, model: str, choices: SequenceOf, text_of, shape
    ) -> list[ResponseEvents]:
        """The event writer of a streamed response (one choice)."""
        return [ResponseEvents(self, self.envelope(body, request_id, model, int(time.time())), shape)]


class ResponseEvents:
    """The events of one streamed response (``ChunkWriter``'s counterpart): ``start``, then per
    engine output ``delta``; ``error`` for a failure after the start."""

    def __init__(self, fmt: ResponsesFormat, response: dict, shape: AnswerShape | None) -> None:
        self.fmt, self.response = fmt, response
        self.answer = AnswerStream(shape) if shape is not None else None  # None: the text as it comes
        self.output: list[dict] = []  # the items closed so far
        self.open: dict | None = None  # the item being streamed
        self.sequence = 0

    def _event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

    def start(self) -> bytes:
        return self._event("response.created", response=self.response) + self._event(
            "response.in_progress", response=self.response
        )

    def delta(self, output: RequestOutput) -> bytes | None:
        if self.answer is not None:
            deltas = self.answer.feed(output.text, final=output.finished)
        else:
            deltas = [Delta("content", output.text)] if output.text else []
        events = [event for d in deltas for event in self._piece(d)]
        if output.finished:
            events += self._finish(output)
        return b"".join(events) or None

    def error(self, body: dict) -> bytes:
        """A failure after the start: OpenAI's ``error`` event (openai-agents fails the run on it);
        its ``code`` the error's, else its type (``server_error``)."""
        error = body.get("error", {})
        code = error.get("code") or error.get("type")
        return self._event("error", code=code, message=error.get("message"), param=error.get("param"))

    def done(self) -> bytes:
        return b""

    # ---- items ------------------------------------------------------------------------------

    def _piece(self, delta: Delta) -> list[bytes]:
        kind = {"content": "message", "reasoning": "reasoning"}.get(delta.kind, "function_call")
        events = []
        if self.open is None or self.open["type"] != kind or (kind == "function_call" and delta.first):
            events += self._close()
            events += self._open(kind, delta.call)
        where = {"item_id": self.open["id"], "output_index": len(self.output)}
        if kind == "function_call":
            if not delta.first and delta.call.arguments:
                self.open["arguments"] += delta.call.arguments
                name = "response.function_call_arguments.delta"
                events.append(self._event(name, **where, delta=delta.call.arguments))
            return events
        self.open["content"][0]["text"] += delta.text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return [*events, self._event(name, **where, content_index=0, delta=delta.text, **extra)]

    def _open(self, kind: str, call: ToolCall | None) -> list[bytes]:
        if kind == "function_call":
            self.open = call_item(_id("fc"), ToolCall(call.name, "", call.id), "in_progress")
        else:
            maker = message_item if kind == "message" else reasoning_item
            self.open = maker(_id("msg" if kind == "message" else "rs"), "", "in_progress")
        where = {"output_index": len(self.output)}
        added = {**self.open, "content": []} if kind != "function_call" else dict(self.open)
        events = [self._event("response.output_item.added", **where, item=added)]
        if kind != "function_call":
            part = self.open["content"][0]
            where |= {"item_id": self.open["id"], "content_index": 0}
            events.append(self._event("response.content_part.added", **where, part=part))
        return events

    def _close(self, status: str = "completed") -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.output)}
        if item["type"] == "function_call":
            events = [self._event("response.function_call_arguments.done", **where, arguments=item["arguments"])]
        else:
            part = item["content"][0]
            name = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events = [
                self._event(name, **where, content_index=0, text=part["text"], **extra),
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]
        events.append(self._event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        return events

    def _finish(self, last: RequestOutput) -> list[bytes]:
        """The open item closed (``incomplete`` when the answer ran out in it), then the whole response."""
        events = []
        if all(item["type"] == "reasoning" for item in [*self.output, *([self.open] if self.open else [])]):
            events += self._close() + self._open("message", None)  # no text, no call: an empty message, as unstreamed
        events += self._close(item_status(status_of(last)[0]))
        response = self.fmt.finished(self.response, last, self.output)
        return [*events, self._event(f"response.{response['status']}", response=response)]
