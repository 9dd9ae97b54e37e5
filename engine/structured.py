"""Structured outputs: a JSON schema as a token mask, through llguidance.

Why llguidance rather than xgrammar (the figures: ``docs/benchmarks/prefix_cache.md``,
"Structured outputs: cost"): both install on Python 3.11 x86_64 beside CPU torch, and both
fill a batch's masks in a small share of a decode step (xgrammar faster per token).
llguidance is one small wheel with no dependencies, while xgrammar pulls in triton and
apache-tvm-ffi on x86_64 Linux for a CPU server that uses neither; and llguidance has no
ahead-of-time compile (a matcher is built cheaply and its lexer grows lazily), so a new
schema costs nothing up front.

The parts:
  * ``check_schema``: the schema as canonical JSON text, refused with a ``FieldError``
    naming ``response_format`` when llguidance cannot use it (no tokenizer needed: the
    ingress calls it before a request leaves it);
  * ``GrammarCache``: one per engine; the tokenizer's llguidance view (slow to build: on the
    first structured request, or at start with ``prepare``) and one matcher
    per schema text, copied for each request;
  * ``GrammarMatcher``: one per request; advanced by every token the request accepts, the
    first included, so a decode replica that is handed a first token resumes in the same
    state as the prefill replica that sampled it;
  * ``apply_grammar_masks``: the masks of a batch's grammar rows, filled in parallel by
    llguidance and unpacked in one op; other rows are not touched.

EOS is in a mask only when the grammar may end there; a request ends (``stop``) as soon as
its grammar is complete. JSON is written without free whitespace (``", "`` and ``": "`` as
separators): whitespace offered everywhere lets a small model pad with newlines until
``max_tokens``, a known failure of JSON-constrained decoding.
"""

from __future__ import annotations

import functools
import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the ingress checks schemas with this module: it never loads torch for them
    import llguidance  # imported where used: an engine that never sees a grammar never loads it
    import torch
    from transformers import PreTrainedTokenizerBase

from engine.params import FieldError

# how JSON is laid out (llguidance's JSON options); see the module docstring
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_OBJECT_SCHEMA = '{"type":"object"}'  # what response_format {"type": "json_object"} asks for
_MAX_CACHED_SCHEMAS = 64
# vLLM's guided_choice and guided_regex, bounded: llguidance's check of a grammar of 40,000 choices
# takes seconds (of 200,000, minutes), on the ingress's event loop and again in the engine
MAX_GUIDED_CHOICES, MAX_GUIDED_CHARS = 1024, 32_768
MAX_GBNF_CHARS = 4_096  # llguidance's GBNF conversion grows with the square of the rules (Lark has no such bound)
_CONTROL = re.compile("[\x7f-\x9f]")  # left unescaped by json.dumps; Lark's lexer refuses them raw


def _grammar(text: str, field: str = "response_format", kind: str = "json") -> str:
    """llguidance's grammar for a JSON schema's text (``kind`` json) or a Lark grammar's (lark);
    ``FieldError`` naming ``field`` if unusable."""
    import llguidance

    noun = "the JSON schema" if kind == "json" else "the grammar"
    try:
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_LAYOUT)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
    except ValueError as exc:
        raise FieldError(f"{field}: {noun} is not valid: {exc}", field) from None
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise FieldError(f"{field}: {noun} cannot be used: {problem}", field)
    return grammar


def lark_grammar(text: str, field: str = "tools") -> str:
    """``_grammar`` of a Lark grammar (a tool-call format's lazy grammar)."""
    return _grammar(text, field, "lark")


def regex_lark(pattern: str, field: str) -> str:
    """A Lark grammar matching the whole output to ``pattern`` (llguidance's regex dialect, as
    llguidance writes it), checked (``FieldError`` naming ``field``)."""
    import llguidance

    if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_GUIDED_CHARS:
        raise FieldError(f"{field}: must be a regular expression of 1 to {MAX_GUIDED_CHARS:,} characters", field)
    if (len(pattern) - len(pattern.rstrip("\\"))) % 2:  # llguidance's Lark text would drop the escape
        raise FieldError(f"{field}: the regular expression ends with an unfinished escape", field)
    text = json.loads(llguidance.LLMatcher.grammar_from_regex(pattern))["grammars"][0]["lark_grammar"]
    lark_grammar(text, field)
    return text


def grammar_lark(text: str, field: str) -> str:
    """vLLM's ``guided_grammar``: a Lark grammar, or a GBNF (EBNF) one (its rules written with
    ``::=``) that llguidance converts, checked (``FieldError`` naming ``field``)."""
    gbnf = isinstance(text, str) and "::=" in text
    limit = MAX_GBNF_CHARS if gbnf else MAX_GUIDED_CHARS
    if not isinstance(text, str) or not text.strip() or len(text) > limit:
        kind = "GBNF" if gbnf else "Lark or GBNF"
        raise FieldError(f"{field}: must be a {kind} grammar of 1 to {limit:,} characters", field)
    lark, problem = _gbnf_to_lark(text) if gbnf else (text, "")
    if problem:
        raise FieldError(f"{field}: the grammar is not valid GBNF: {problem}", field)
    lark_grammar(lark, field)
    return lark


@functools.lru_cache(maxsize=64)  # a batch's prompts each convert their request's grammar
def _gbnf_to_lark(text: str) -> tuple[str, str]:
    """(the Lark grammar, "") or ("", what is wrong)."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text), ""
    except Exception as exc:  # the converter's own error, or any other it meets on malformed text
        return "", str(exc) or type(exc).__name__


_SPACE = "/[ \\t\\r\\n]*/"  # between the reasoning and the answer (a template writes "\n\n")


def after_reasoning(grammar: tuple[str, str], close_tag: str, open_tag: str | None, field: str) -> str:
    """vLLM's structured outputs with a reasoning parser, as one Lark grammar: free reasoning
    text up to ``close_tag``, white space, then ``grammar`` ((text, kind): a JSON schema's text,
    laid out as the engine writes JSON, or a Lark grammar's, nested). ``open_tag``: the model
    opens its reasoning itself, so it may also answer at once (Qwen3); None: the chat template
    opened it (DeepSeek-R1), so the reasoning comes first. Checked (``FieldError`` naming ``field``)."""
    text, kind = grammar
    if kind == "json":
        schema = json.loads(text)
        answer = "%json " + json.dumps({"x-guidance": _JSON_LAYOUT} | schema if isinstance(schema, dict) else schema)
    else:
        answer = "%lark {\n" + text + "\n}"
    reasoning = f"think {_SPACE}" if open_tag is None else f"({json.dumps(open_tag)} think {_SPACE})?"
    rules = [f"start: {reasoning} answer", f"think[suffix={json.dumps(close_tag)}]: /(?s:.*)/", f"answer: {answer}"]
    lark = "\n".join(rules)
    lark_grammar(lark, field)
    return lark


def choice_lark(choices: Sequence[str], field: str) -> str:
    """A Lark grammar matching the whole output to one of ``choices``, checked."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise FieldError(f"{field}: must be a list of non-empty strings", field)
    if len(choices) > MAX_GUIDED_CHOICES or sum(map(len, choices)) > MAX_GUIDED_CHARS:
        message = f"at most {MAX_GUIDED_CHOICES:,} choices of {MAX_GUIDED_CHARS:,} characters in all"
        raise FieldError(f"{field}: {message} (checking a grammar grows faster than its size)", field)
    literals = (_CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(c, ensure_ascii=False)) for c in choices)
    text = "start: " + " | ".join(literals)
    lark_grammar(text, field)
    return text


def check_schema(schema: dict, field: str = "response_format") -> str:
    """``schema`` as the JSON text ``SamplingParams.json_schema`` takes, after checking that
    llguidance can enforce it (else a ``FieldError`` naming ``field``). Keys keep their order (it
    is the order properties are written in)."""
    if not isinstance(schema, dict):
        raise FieldError(f"{field}: the JSON schema must be an object", field)
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    _grammar(text, field)
    return text


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def advance(self, token: int) -> bool:
        """Accept one token; False if the grammar refused it (then it stays refused)."""
        return self._matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but EOS can follow."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    @property
    def llmatcher(self) -> llguidance.LLMatcher:
        return self._matcher


class GrammarCache:
    """The grammars of one engine's tokenizer, by schema text (least recently used dropped
    beyond ``max_schemas``)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        vocab_size: int,
        eos_ids: Sequence[int],
        max_schemas: int = _MAX_CACHED_SCHEMAS,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_ids = sorted(eos_ids)
        self._max_schemas = max_schemas
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._matchers: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None
        self.num_compiled = 0  # schemas turned into a matcher (cache misses)

    def matcher(self, schema_json: str, kind: str = "json", field: str | None = None) -> GrammarMatcher:
        """A fresh matcher at the start of the schema's grammar; ``FieldError`` naming ``field``
        (by default ``response_format`` for a schema, ``tools`` for a Lark grammar) if it cannot
        be used with this tokenizer."""
        key = (kind, schema_json)
        template = self._matchers.get(key)
        if template is None:
            template = self._compile(schema_json, kind, field or ("response_format" if kind == "json" else "tools"))
            self._matchers[key] = template
            if len(self._matchers) > self._max_schemas:
                self._matchers.popitem(last=False)
        self._matchers.move_to_end(key)
        return GrammarMatcher(template.deep_copy())

    def prepare(self) -> None:
        """Build the tokenizer's llguidance view now (about a second on a CPU core) rather than
        on the first structured request, which would hold the engine's step loop that long."""
        if self._tokenizer is not None:
            self._tokenizer_view()

    def _tokenizer_view(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            raise FieldError("response_format: this model has no tokenizer to write JSON with", "response_format")
        if self._lltokenizer is None:
            import llguidance.hf

            self._lltokenizer = llguidance.hf.from_tokenizer(
                self._tokenizer,
                n_vocab=self._vocab_size,
                eos_token=self._eos_ids or None,
                slices=llguidance.LLTokenizer.json_slices(),
            )
        return self._lltokenizer

    def _compile(self, text: str, kind: str, field: str) -> llguidance.LLMatcher:
        import llguidance

        grammar = _grammar(text, field, kind)
        matcher = llguidance.LLMatcher(self._tokenizer_view(), grammar, log_level=0)
        if matcher.is_error():
            raise FieldError(f"{field}: the grammar cannot be used: {matcher.get_error()}", field)
        self.num_compiled += 1
        return matcher

    @property
    def executor(self) -> llguidance.LLExecutor:
        """Fills a batch's masks on several threads (the GIL released)."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._executor


def apply_grammar_masks(
    logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None], executor: llguidance.LLExecutor
) -> None:
    """Set to -inf, in place, every token a row's grammar does not allow next; rows without a
    grammar are left alone. The bitmask (32 tokens per int32) is filled on the CPU by
    llguidance's threads, unpacked on the logits' device in one batched op, and applied to
    each grammar row's view of ``logits`` (no gather or scatter of rows)::

        bit b of word w of a row  ->  token 32 * w + b   (1: allowed)
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    import llguidance.torch
    import torch

    vocab = logits.shape[-1]
    bitmask = llguidance.torch.allocate_token_bitmask(len(rows), vocab)
    targets = [(matchers[r].llmatcher, k) for k, r in enumerate(rows)]
    llguidance.torch.fill_next_token_bitmask_par(executor, targets, bitmask)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    refused = (((bitmask.unsqueeze(-1) >> bits) & 1) == 0).flatten(1)[:, :vocab]
    for k, row in enumerate(rows):
        logits[row].masked_fill_(refused[k], float("-inf"))
