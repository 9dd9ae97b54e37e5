"""Tool calls and reasoning in a chat model's text: the parsers that find them (vLLM's names),
the JSON Schemas that force them, and their incremental form for streamed responses.

Tool-call parsers (``api.tool_call_parser``), each for one model family's call format:
  * ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call
    (Hermes 2 Pro, Qwen2.5, Qwen3, and this project's ChatML template for the default model);
  * ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}`` objects separated
    by ``;``, optionally after ``<|python_tag|>`` (Llama 3.1 / 3.2 with JSON tools);
  * ``mistral``: ``[TOOL_CALLS]`` then a JSON list of calls, or ``name[ARGS]{...}`` per call;
  * ``pythonic``: the whole answer is a Python list of calls, ``[f(a=1), g(b="x")]`` (Llama 3.2 /
    4), read with ``ast`` (literals only, never evaluated).
Text that looks like a call but does not parse stays content. A call's ``arguments`` is JSON
text of an object, as OpenAI sends it.

Reasoning parsers (``api.reasoning_parser``): ``deepseek_r1`` (the template opens ``<think>``:
everything before ``</think>`` is reasoning, all of it while that never comes) and ``qwen3``
(reasoning only inside ``<think>...</think>`` at the start; without it, all content).

Forced calls (``tool_choice`` ``"required"`` or a named function) are generated under a JSON
Schema (``forced_schema``): a list of ``{"name", "parameters"}`` items for ``required`` (one item
unless ``parallel_tool_calls``), the function's own ``parameters`` for a named one; every such
call parses and validates against its schema.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from llguidance import StructTag

from app.tool_schemas import JSON_LAYOUT, forced_schema


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Parsed:
    """A chat answer split: its text content (None when there is none) and its calls."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


def _content(text: str) -> str | None:
    return text.strip() or None


def _joined(before: str, after: str) -> str | None:
    """The content of an answer with calls: the text before them, then what is left around them."""
    return "\n".join(p for p in (before.strip(), after.strip()) if p) or None


_ARGUMENTS = ("arguments", "parameters")  # where a call's arguments may be, in the order looked for


def _arguments_text(arguments: Any) -> str | None:
    """An object as the ``arguments`` JSON text (ASCII, no NaN or infinity: what every JSON reader
    takes), or None for anything else."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    try:
        return json.dumps(arguments, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return None


def _as_call(
    item: Any, names: frozenset[str] | None, keys: Sequence[str] = ("arguments", "parameters")
) -> ToolCall | None:
    """A call from a decoded ``{"name": ..., "arguments": {...}}`` (arguments may be JSON text);
    None when it is not one, has no arguments, or names a function not among ``names``."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    if names is not None and item["name"] not in names:
        return None
    key = next((k for k in keys if k in item), None)
    arguments = _arguments_text(item[key]) if key is not None else None
    return None if arguments is None else ToolCall(item["name"], arguments)


def _decode_all(text: str, separators: str = "") -> list[Any] | None:
    """The JSON values of ``text`` one after another (whitespace and ``separators`` between them);
    None when anything else is there."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            return None
        values.append(value)


class ToolParser(ABC):
    """One call format. ``parse`` splits a whole answer; ``start`` finds where calls begin, and
    ``closed`` the calls complete so far in a region still being written (streaming)."""

    name: ClassVar[str]
    triggers: ClassVar[tuple[str, ...]]  # text that opens the calls
    at_start_only: ClassVar[bool] = False  # calls only when the answer opens with a trigger
    closer: ClassVar[str | None] = None  # text that ends one call (None: calls are read whole)

    def __init__(self, names: Sequence[str] | None = None) -> None:
        """``names``: the request's functions; a call of another stays content (None: any name)."""
        self.names = frozenset(names) if names is not None else None

    def start(self, text: str) -> int | None:
        if self.at_start_only:
            stripped = text.lstrip()
            return len(text) - len(stripped) if stripped.startswith(self.triggers) else None
        found = [i for i in (text.find(t) for t in self.triggers) if i >= 0]
        return min(found) if found else None

    def parse(self, text: str) -> Parsed:
        begin = self.start(text)
        if begin is None:
            return Parsed(_content(text))
        calls, rest = self.safe_region(text[begin:])
        if not calls:
            return Parsed(_content(text))
        return Parsed(_joined(text[:begin], rest), tuple(calls))

    def safe_region(self, region: str) -> tuple[list[ToolCall], str]:
        """``region``'s reading, or none of it a call when the text defeats the reader (a nesting
        too deep, a number too long to hold): model text never fails a response."""
        try:
            return self.region(region)
        except (RecursionError, MemoryError, ValueError, TypeError):
            return [], region

    @abstractmethod
    def region(self, region: str) -> tuple[list[ToolCall], str]:
        """The calls of the text from the first trigger on, and what of it is not a call."""

    def closed(self, region: str) -> list[ToolCall]:
        """The calls already complete in a region still being written (in order; default none:
        the format can only be read whole)."""
        return []

    def lazy_grammar(self, functions: Sequence[dict[str, Any]]) -> str | None:
        """An llguidance grammar for ``tool_choice: auto``: any text until a call's trigger, then
        the call forced to a declared function with valid arguments (None: the format has no
        trigger to wait for, so the model's text is only parsed)."""
        return None

    @staticmethod
    def _tags(functions: Sequence[dict[str, Any]], trigger: str, begin: str, end: str) -> str:
        """``StructTag``s of llguidance: after ``trigger`` the text ``begin`` (with ``{name}``), the
        function's parameters as JSON in the project's layout, then ``end``."""
        tags = [
            StructTag(
                trigger=trigger,
                begin=begin.format(name=json.dumps(f["name"])),
                grammar=forced_schema(functions, f["name"], False) | {"x-guidance": JSON_LAYOUT},
                end=end,
            )
            for f in functions
        ]
        return StructTag.to_grammar(tags, assume_special=False)


class HermesParser(ToolParser):
    name, triggers, closer = "hermes", ("<tool_call>",), "</tool_call>"
    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def region(self, region: str) -> tuple[list[ToolCall], str]:
        calls, rest, end = [], [], 0
        for match in self.BLOCK.finditer(region):
            rest.append(region[end : match.start()])
            values = _decode_all(match.group(1))
            call = _as_call(values[0], self.names) if values and len(values) == 1 else None
            if call is None:
                rest.append(match.group(0))
            else:
                calls.append(call)
            end = match.end()
        return calls, "".join([*rest, region[end:]])

    def closed(self, region: str) -> list[ToolCall]:
        blocks = [m for m in self.BLOCK.finditer(region) if m.group(0).endswith("</tool_call>")]
        return self.safe_region("".join(m.group(0) for m in blocks))[0]

    def lazy_grammar(self, functions: Sequence[dict[str, Any]]) -> str | None:
        return self._tags(functions, "<tool_call>", '<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>")


class Llama3JsonParser(ToolParser):
    name, triggers, at_start_only = "llama3_json", ("<|python_tag|>", "{"), True

    def region(self, region: str) -> tuple[list[ToolCall], str]:
        values = _decode_all(region.strip().removeprefix("<|python_tag|>"), separators=";")
        calls = [_as_call(v, self.names, ("parameters", "arguments")) for v in values or ()]
        return ([], region) if not calls or None in calls else (calls, "")


class MistralParser(ToolParser):
    name, triggers = "mistral", ("[TOOL_CALLS]",)
    NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[ARGS\])?\s*(?=\{)")

    def region(self, region: str) -> tuple[list[ToolCall], str]:
        calls: list[ToolCall | None] = []
        for piece in region.split("[TOOL_CALLS]")[1:]:
            if piece.lstrip().startswith("["):
                values = _decode_all(piece)
                listed = values[0] if values and len(values) == 1 and isinstance(values[0], list) else [None]
                calls += [_as_call(v, self.names) for v in listed or [None]]
            elif (named := self.NAMED.match(piece)) is not None:
                values = _decode_all(piece[named.end() :])
                arguments = values[0] if values and len(values) == 1 else None
                calls.append(_as_call({"name": named.group(1), "arguments": arguments}, self.names))
            else:
                calls.append(None)
        return ([], region) if not calls or None in calls else (calls, "")

    def lazy_grammar(self, functions: Sequence[dict[str, Any]]) -> str | None:
        return self._tags(functions, "[TOOL_CALLS]", '[TOOL_CALLS][{{"name": {name}, "arguments": ', "}]")


class PythonicParser(ToolParser):
    name, triggers, at_start_only = "pythonic", ("<|python_start|>", "["), True
    NAMES = {"true": True, "false": False, "null": None}  # JSON's literals, as some models write them

    def region(self, region: str) -> tuple[list[ToolCall], str]:
        text = region.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        try:
            tree = ast.parse(text, mode="eval").body
            calls = [self._call(node) for node in tree.elts] if isinstance(tree, ast.List) else []
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            calls = []
        return (calls, "") if calls else ([], region)

    def _call(self, node: ast.AST) -> ToolCall:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
            raise ValueError("not a call with keyword arguments")
        if any(k.arg is None for k in node.keywords):
            raise ValueError("**arguments are not literals")
        name, arguments = (
            ast.unparse(node.func),
            _arguments_text({k.arg: self._literal(k.value) for k in node.keywords}),
        )
        if arguments is None or self.names is not None and name not in self.names:
            raise ValueError("not a call of a declared function with JSON arguments")
        return ToolCall(name, arguments)

    def _literal(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Name) and node.id in self.NAMES:
            return self.NAMES[node.id]
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self._literal(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            keys = [self._literal(k) for k in node.keys]
            if not all(isinstance(k, str) for k in keys):
                raise ValueError("a JSON object's keys are strings")
            return dict(zip(keys, (self._literal(v) for v in node.values)))
        value = ast.literal_eval(node)
        if not isinstance(value, (str, int, float, bool, type(None))):
            raise ValueError(f"{type(value).__name__} is not a JSON value")
        return value


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
}


def parser_for_template(template: str | None) -> str | None:
    """The call format a chat template writes, when its text tells (``api.tool_call_parser``'s default)."""
    if not template:
        return None
    for marker, name in (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json")):
        if marker in template:
            return name
    return None


# ---- reasoning ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReasoningParser:
    """``<think>...</think>``; ``implicit``: the template opened the tag, so text is reasoning
    until it closes (DeepSeek-R1), else only an answer that opens the tag reasons (Qwen3)."""

    name: str
    implicit: bool
    open_tag: ClassVar[str] = "<think>"
    close_tag: ClassVar[str] = "</think>"

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer."""
        stripped = text.lstrip()
        opened = stripped.startswith(self.open_tag)
        if not opened and not self.implicit:
            return None, _content(text)
        reasoning, closed, content = stripped.removeprefix(self.open_tag).partition(self.close_tag)
        return _content(reasoning), _content(content) if closed else None


REASONING_PARSERS = {p.name: p for p in (ReasoningParser("deepseek_r1", True), ReasoningParser("qwen3", False))}


# ---- forced calls ------------------------------------------------------------------------------
def parse_forced(text: str, named: str | None) -> Parsed:
    """The calls of an answer generated under ``forced_schema``: a named call's arguments are the
    text as it is (cut by ``max_tokens``: as far as it got); a list that does not parse whole (cut)
    stays content."""
    if named is not None:
        return Parsed(None, (ToolCall(named, text.strip()),))
    values = _decode_all(text)
    items = values[0] if values and len(values) == 1 and isinstance(values[0], list) else []
    calls = [c for c in (_as_call(i, None, ("parameters",)) for i in items) if c is not None]
    return Parsed(None if calls else _content(text), tuple(calls))


# ---- streaming ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Delta:
    """A piece of a streamed answer: text of ``kind`` ("content" or "reasoning"), or one call
    (``call``, at ``index`` among the answer's calls) with, when ``first``, its id, type and name."""

    kind: str
    text: str = ""
    call: ToolCall | None = None
    index: int = 0
    first: bool = True


def _held(text: str, tags: Sequence[str]) -> int:
    """How many characters at the end of ``text`` may begin one of ``tags`` (kept back)."""
    return max((n for tag in tags for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)


class _Trim:
    """Text as ``str.strip`` would leave it, sent in pieces: leading whitespace dropped, trailing
    whitespace held until more text follows it (and dropped at the end)."""

    def __init__(self) -> None:
        self.started, self.held = False, ""

    def push(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body) :]
        return body


class ReasoningStream:
    """``ReasoningParser.split`` over text that arrives in pieces."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser, self.buffer, self.mode = parser, "", "undecided"
        self.trims = {"reasoning": _Trim(), "content": _Trim()}

    def feed(self, text: str, final: bool = False) -> Iterator[Delta]:
        self.buffer += text
        if self.mode == "undecided":
            stripped, tag = self.buffer.lstrip(), self.parser.open_tag
            if not final and tag.startswith(stripped):
                return  # the tag, perhaps, not yet whole
            opened = stripped.startswith(tag)
            self.mode = "reasoning" if opened or self.parser.implicit else "content"
            self.buffer = stripped.removeprefix(tag) if opened else self.buffer
        if self.mode == "reasoning":
            reasoning, closed, rest = self.buffer.partition(self.parser.close_tag)
            keep = 0 if closed or final else _held(reasoning, [self.parser.close_tag])
            yield from self._emit("reasoning", reasoning[: len(reasoning) - keep])
            self.buffer, self.mode = (rest, "content") if closed else (reasoning[len(reasoning) - keep :], "reasoning")
        if self.mode == "content":
            yield from self._emit("content", self.buffer)
            self.buffer = ""

    def _emit(self, kind: str, text: str) -> Iterator[Delta]:
        if piece := self.trims[kind].push(text):
            yield Delta(kind, piece)


class ToolCallStream:
    """``ToolParser.parse`` over text that arrives in pieces: content passes until the calls may
    begin; each call goes out once complete (its first delta with id, type and name, the
    arguments in the next); at the end what did not parse as a call goes out as content."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text, self.sent, self.region_at = "", 0, None  # all text; content sent up to; calls from
        self.num_calls = 0

    def feed(self, text: str) -> Iterator[Delta]:
        self.text += text
        if self.region_at is None:
            self.region_at = self.parser.start(self.text)
        if self.region_at is None:
            yield from self._content(self._safe_end())
            return
        yield from self._content(self.region_at)
        closer = self.parser.closer
        if closer is not None and closer in self.text[-(len(text) + len(closer)) :]:  # a call just ended
            yield from self._calls(self.parser.closed(self.text[self.region_at :]))

    def finish(self) -> Iterator[Delta]:
        parsed = self.parser.parse(self.text)
        if not parsed.calls:
            yield from self._content(len(self.text))
            return
        yield from self._calls(list(parsed.calls))
        rest = self.parser.safe_region(self.text[self.region_at :])[1].strip()
        if rest:
            yield Delta("content", ("\n" if self.sent else "") + rest)

    def _safe_end(self) -> int:
        """Where content that cannot begin calls ends: before a possible trigger's beginning, or
        (triggers only at the start) nowhere while the answer may still open with one."""
        if not self.parser.at_start_only:
            return len(self.text) - _held(self.text, self.parser.triggers)
        stripped = self.text.lstrip()
        return 0 if self.sent == 0 and any(t.startswith(stripped) for t in self.parser.triggers) else len(self.text)

    def _content(self, end: int) -> Iterator[Delta]:
        """The content up to ``end``, as ``str.strip`` would leave the whole (see ``_Trim``)."""
        start = self.sent or len(self.text) - len(self.text.lstrip())
        stop = start + len(self.text[start:end].rstrip())
        if stop > start:
            self.sent = stop
            yield Delta("content", self.text[start:stop])

    def _calls(self, calls: list[ToolCall]) -> Iterator[Delta]:
        for call in calls[self.num_calls :]:
            yield Delta("call", call=call, index=self.num_calls, first=True)
            yield Delta("call", call=call, index=self.num_calls, first=False)
            self.num_calls += 1


# ---- one request's answer ----------------------------------------------------------------------
@dataclass(frozen=True)
class AnswerShape:
    """How one chat request's answer is read: the reasoning split off, then the calls found by
    ``parser`` (``tool_choice`` auto), or the whole answer a forced call (``named``: that
    function's arguments; else a list of calls)."""

    reasoning: ReasoningParser | None = None
    parser: ToolParser | None = None
    forced: bool = False
    named: str | None = None

    def read(self, text: str) -> tuple[str | None, Parsed]:
        """(reasoning, content and calls) of a whole answer."""
        if self.forced:
            return None, parse_forced(text, self.named)
        reasoning, content = self.reasoning.split(text) if self.reasoning is not None else (None, text)
        if self.parser is not None and content is not None:
            return reasoning, self.parser.parse(content)
        return reasoning, Parsed(_content(content or ""))


class AnswerStream:
    """``AnswerShape.read`` over an answer that arrives in pieces (one per choice)."""

    def __init__(self, shape: AnswerShape) -> None:
        self.shape, self.text, self.num_calls = shape, "", 0
        forced = shape.forced
        self.reasoning = ReasoningStream(shape.reasoning) if shape.reasoning and not forced else None
        self.tools = ToolCallStream(shape.parser) if shape.parser and not forced else None
        self.named = ToolCall(shape.named, "") if forced and shape.named else None

    def feed(self, text: str, final: bool = False) -> list[Delta]:
        if self.shape.forced:
            return self._forced(text, final)
        pieces = list(self.reasoning.feed(text, final)) if self.reasoning else [Delta("content", text)]
        deltas: list[Delta] = []
        for piece in pieces:
            deltas += self.tools.feed(piece.text) if self.tools and piece.kind == "content" else [piece]
        if final and self.tools is not None:
            deltas += self.tools.finish()
        self.num_calls += sum(d.kind == "call" and d.first for d in deltas)
        return [d for d in deltas if d.kind == "call" or d.text]

    def _forced(self, text: str, final: bool) -> list[Delta]:
        if self.named is not None:  # the answer is the arguments: they stream as they come
            deltas = [] if self.num_calls else [Delta("call", call=self.named)]
            self.num_calls = 1
            if text:
                deltas.append(Delta("call", call=ToolCall(self.named.name, text, self.named.id), first=False))
            return deltas
        self.text += text
        if not final:
            return []
        parsed = parse_forced(self.text, None)
        self.num_calls = len(parsed.calls)
        if not parsed.calls:
            return [Delta("content", parsed.content)] if parsed.content else []
        return [Delta("call", call=c, index=i, first=f) for i, c in enumerate(parsed.calls) for f in (True, False)]
