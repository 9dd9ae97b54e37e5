"""Request-level parameters and the result types that cross the engine's seams.

``SamplingParams`` and ``GenerationRequest`` validate themselves on construction: every
invalid field raises a ``FieldError`` (a ``ValueError``) that carries the field's name as
data, before the engine allocates anything. ``check_fits`` is the one length and
vocabulary check, used by the ingress (before a request leaves it) and by the engine.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# below this temperature sampling is greedy (as vLLM does): dividing the logits by a
# smaller one overflows them to inf, and softmax then gives NaN
GREEDY_BELOW = 1e-5
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes
MAX_STOP_STRINGS = 4  # as OpenAI
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty, as OpenAI
LOGIT_BIAS_RANGE = (-100.0, 100.0)


class Role(StrEnum):
    """What an engine replica does with the requests it admits.

    ``prefill``: run the prompt, sample the first token, keep the blocks pinned until
    ``release``. ``decode``: continue from KV placed in reserved blocks. ``both``: the
    whole request. The role is state, not code: it can change while the engine runs.
    """

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # the engine could not finish it (see RequestOutput.error)


class FieldError(ValueError):
    """Bad input, naming the request field it is about as data (``param``: the field of an
    OpenAI error body, None when no single field is to blame). Keeps its type and fields
    across Ray (pickled by ``__reduce__``), so callers catch it by type, never by text."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self) -> tuple:
        return (self.__class__, (self.message, self.param))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature`` below ``GREEDY_BELOW`` (0 included) is greedy. A sampled row is filtered,
    after the temperature, by ``min_p`` (tokens less likely than ``min_p`` times the most
    likely one are dropped), then ``top_k`` and ``top_p``: ``min_p=0``, ``top_k=None`` and
    ``top_p=1.0`` disable them.
    ``seed`` makes sampling reproducible per request, independent of batch neighbours.
    ``logprobs=n`` returns the top-n log-probabilities of every generated token;
    ``prompt_logprobs=n`` those of every prompt token after the first, in the first output (the
    prompt is then computed whole: no prefix-cache hit skips a position).

    Logits processing, before temperature, top-k and top-p, and for greedy requests too (it
    moves the argmax): ``allowed_token_ids`` (vLLM's: every other token masked), then
    ``logit_bias`` (token id -> bias added), then ``repetition_penalty`` (vLLM's: the logit of a
    token seen in the prompt or the output is divided by it when positive, multiplied when
    negative), then ``presence_penalty`` and ``frequency_penalty`` (OpenAI's: ``presence *
    [count > 0] + frequency * count`` subtracted, counting the tokens generated so far), then
    the tokens held back (EOS and stop token ids before ``min_tokens``, unless that would leave
    none of ``allowed_token_ids``; the last token of each of ``bad_words_token_ids``, vLLM's
    ``bad_words``, where the output ends with the rest of it), then the ``json_schema``
    grammar's mask. ``logprobs`` stay those of
    the raw model distribution, before any of this.

    ``json_schema``: the output must be JSON matching this schema, given as its JSON text
    (plain data: it pickles through Ray and keys the engine's grammar cache); the client's
    field is ``response_format``. ``lark_grammar``: an llguidance Lark grammar in its place (a
    tool-call format's lazy grammar: free text until a call's trigger, then the call forced).
    Every field is plain data, so that a decode replica rebuilds the request's sampling state
    from the request and the tokens so far.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id; a mapping is accepted
    allowed_token_ids: tuple[int, ...] = ()  # the only tokens it may sample; empty: all
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # vLLM's bad_words, tokenized (``bad_word_ids``)
    json_schema: str | None = None
    lark_grammar: str | None = None
    grammar_field: str | None = None  # the client's field the grammar came from (None: response_format or tools)

    def __post_init__(self) -> None:
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1", self.max_tokens)
        _require(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            "an integer in [0, max_tokens]",
            self.min_tokens,
        )
        _require(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            "a finite number >= 0",
            self.temperature,
        )
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a finite number in (0, 1]", self.top_p)
        _require(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a finite number in [0, 1]", self.min_p)
        _require(
            self.top_k is None or (_is_int(self.top_k) and self.top_k >= 1),
            "top_k",
            "an integer >= 1 or None",
            self.top_k,
        )
        _require(
            self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]),
            "seed",
            "an integer in [-2**63, 2**64) or None",
            self.seed,
        )
        object.__setattr__(self, "stop", _normalize_stop(self.stop))
        ids = self.stop_token_ids
        valid_ids = not isinstance(ids, (str, bytes)) and all(_is_int(t) and t >= 0 for t in ids)
        _require(valid_ids, "stop_token_ids", "a list of token ids", ids)
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            _require(isinstance(getattr(self, name), bool), name, "a boolean", getattr(self, name))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            valid = value is None or (_is_int(value) and 0 <= value <= 20)
            _require(valid, name, "an integer in [0, 20] or None", value)
        self._check_logits_processing()

    def _check_logits_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            valid = _is_number(value) and PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]
            _require(valid, name, "a finite number in [-2, 2]", value)
        rp = self.repetition_penalty
        _require(_is_number(rp) and rp > 0, "repetition_penalty", "a finite number > 0", rp)
        object.__setattr__(self, "logit_bias", _normalize_logit_bias(self.logit_bias))
        schema = self.json_schema
        _require(schema is None or _is_json_object(schema), "response_format", "a JSON schema object as text", schema)
        lark = self.lark_grammar
        _require(lark is None or isinstance(lark, str) and schema is None, "tools", "one grammar, as text", lark)
        named = self.grammar_field
        _require(named is None or isinstance(named, str), "grammar_field", "a field name or None", named)
        ids = self.allowed_token_ids
        valid_ids = not isinstance(ids, (str, bytes)) and all(_is_int(t) and t >= 0 for t in ids)
        _require(valid_ids, "allowed_token_ids", "a list of token ids", ids)
        object.__setattr__(self, "allowed_token_ids", tuple(ids))
        _require(not (ids and self.grammar), "allowed_token_ids", "left out when the output follows a grammar", ids)
        words = self.bad_words_token_ids
        valid_words = not isinstance(words, (str, bytes)) and all(
            not isinstance(w, (str, bytes)) and len(w) > 0 and all(_is_int(t) and t >= 0 for t in w) for w in words
        )
        _require(valid_words, "bad_words", "token id sequences", words)
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in words))
        # a grammar's tokens and these bans together may leave a step nothing to sample
        _require(not (words and self.grammar), "bad_words", "left out when the output follows a grammar", words)

    @property
    def grammar(self) -> tuple[str, str] | None:
        """The grammar the output follows, as (text, kind): kind ``json`` or ``lark``; None: none."""
        if self.json_schema is not None:
            return self.json_schema, "json"
        return (self.lark_grammar, "lark") if self.lark_grammar is not None else None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether any penalty applies (they need the request's token counts)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def check_token_ids(self, vocab_size: int) -> None:
        """Refuse ``logit_bias``, ``stop_token_ids`` and ``allowed_token_ids`` ids outside the
        vocabulary (``FieldError`` naming the field): an id beyond the logits found inside a step
        would fail every request in the batch."""
        words = [t for word in self.bad_words_token_ids for t in word]
        listed = [t for t, _ in self.logit_bias], self.stop_token_ids, self.allowed_token_ids, words
        for name, ids in zip(("logit_bias", "stop_token_ids", "allowed_token_ids", "bad_words"), listed, strict=True):
            if ids and (largest := max(ids)) >= vocab_size:
                message = f"token id {largest} is out of vocabulary (the model has {vocab_size} ids)"
                raise FieldError(f"{name}: {message}", name)


def bad_word_ids(tokenizer: PreTrainedTokenizerBase, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words`` as token id sequences: each word as it starts a text and, where that
    gives as many tokens but another first one, after a space (a word inside the text)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        inside = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        spaced = bool(alone) and len(inside) == len(alone) and inside[0] != alone[0]
        sequences += [ids for ids in (alone, inside if spaced else ()) if ids and ids not in sequences]
    return tuple(sequences)


def _require(valid: bool, param: str, expected: str, value: object) -> None:
    if not valid:
        raise FieldError(f"{param} must be {expected}, got {value!r}", param)


def _normalize_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise FieldError(f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise FieldError(f"stop must be at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    return tuple(stop)


def _normalize_logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """``{id: bias}`` or ``((id, bias), ...)`` -> ``((id, bias), ...)`` sorted by id; ids as
    ints or decimal strings (OpenAI's JSON keys), biases in [-100, 100]."""
    items = list(bias.items()) if isinstance(bias, Mapping) else bias
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, (list, tuple)) and len(i) == 2 for i in items):
        raise FieldError(f"logit_bias must map token ids to biases, got {bias!r}", "logit_bias")
    pairs: dict[int, float] = {}
    for token, value in items:
        if isinstance(token, str) and token.isdecimal():
            token = int(token)
        if not (_is_int(token) and token >= 0):
            raise FieldError(f"logit_bias: keys must be token ids (non-negative integers), got {token!r}", "logit_bias")
        if not (_is_number(value) and LOGIT_BIAS_RANGE[0] <= value <= LOGIT_BIAS_RANGE[1]):
            message = f"logit_bias: the bias of token {token} must be in [-100, 100], got {value!r}"
            raise FieldError(message, "logit_bias")
        pairs[token] = float(value)
    return tuple(sorted(pairs.items()))


def _is_json_object(text: object) -> bool:
    if not isinstance(text, str):
        return False
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


# the random part ``unique_request_id`` adds, before the choice (-<i>) and retry suffixes
_UNIQUE_PART = re.compile(r"\.[0-9a-f]{8}(?=(?:-\d+)*(?:-retry)?$)")


def unique_request_id(client_id: str) -> str:
    """A client's request id (``X-Request-Id``) made unique, ``<id>.<8 hex>``: the engines key
    requests by id, and a client may reuse one while its first request is still held on a replica."""
    return f"{client_id}.{secrets.token_hex(4)}"


def client_request_id(request_id: str) -> str:
    """A request id without the random part ``unique_request_id`` added (choice and retry
    suffixes kept): what a draw that must repeat from run to run hashes."""
    return _UNIQUE_PART.sub("", request_id, count=1)


@dataclass(frozen=True)
class GenerationRequest:
    """One request as the engine sees it: already tokenized."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        _require(
            isinstance(self.request_id, str) and bool(self.request_id),
            "request_id",
            "a non-empty string",
            self.request_id,
        )
        ids = self.prompt_token_ids
        if isinstance(ids, (str, bytes)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise FieldError("prompt must be a list of non-negative token ids", "prompt")
        if len(ids) == 0:
            raise FieldError("prompt must not be empty", "prompt")
        object.__setattr__(self, "prompt_token_ids", tuple(ids))


@dataclass(frozen=True)
class ContextLimits:
    """What a request must fit: the context served and the vocabulary (``vocab_size`` None:
    ids are not checked, e.g. a model without a tokenizer at the ingress), and the server's
    own caps on the prompt and the output (``limits.max_prompt_tokens`` / ``limits.max_tokens``
    at the ingress; None: the context alone bounds them)."""

    max_model_len: int
    vocab_size: int | None = None
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """A request's ``max_tokens`` when it sets none: the rest of the context, at most the cap."""
        room = self.max_model_len - num_prompt_tokens
        return room if self.max_tokens is None else min(room, self.max_tokens)


def check_fits(
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    limits: ContextLimits,
    prompt_field: str = "prompt",
    max_tokens_field: str = "max_tokens",
) -> None:
    """Refuse ids outside the vocabulary, a prompt over the cap or that fills the context, and
    ``max_tokens`` over the cap or beyond the room left (``FieldError`` naming the client's
    field: ``messages`` for a chat, ``max_completion_tokens`` when that was set). Called before
    anything is allocated: a bad id found inside a step would fail every request in the batch."""
    num_prompt, limit = len(prompt_token_ids), limits.max_model_len
    if limits.vocab_size is not None and (largest := max(prompt_token_ids)) >= limits.vocab_size:
        message = f"token id {largest} is out of vocabulary (the model has {limits.vocab_size} ids)"
        raise FieldError(f"{prompt_field}: {message}", prompt_field)
    if limits.max_prompt_tokens is not None and num_prompt > limits.max_prompt_tokens:
        message = f"the prompt is {num_prompt} tokens, over this server's limit of {limits.max_prompt_tokens}"
        raise FieldError(f"{prompt_field}: {message} (limits.max_prompt_tokens)", prompt_field)
    if num_prompt >= limit:
        message = f"the prompt is {num_prompt} tokens, the context (max_model_len) is {limit} tokens"
        raise FieldError(f"{prompt_field}: {message}", prompt_field)
    if limits.max_tokens is not None and max_tokens > limits.max_tokens:
        message = f"{max_tokens} is over this server's limit of {limits.max_tokens} (limits.max_tokens)"
        raise FieldError(f"{max_tokens_field}: {message}", max_tokens_field)
    if num_prompt + max_tokens > limit:
        message = (
            f"{max_tokens} is beyond the context: prompt {num_prompt} tokens + {max_tokens_field} > "
            f"max_model_len {limit}"
        )
        raise FieldError(f"{max_tokens_field}: {message}", max_tokens_field)


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the sampled token and the top-n alternatives at one position."""

    token_id: int
    logprob: float | None  # None only for a prompt's first token, which nothing predicts (``echo``)
    top: tuple[tuple[int, float], ...]
    rank: int | None = None  # the token's place in the distribution, 1 the most likely (scored prompt tokens)


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """What one step produced for one request: new tokens, their text, and the end."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: tuple[TokenLogprobs, ...] = ()
    # on the first output of a request asking ``prompt_logprobs``: prompt tokens 1.. (the first has none)
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    error: str | None = None
    # set when a prefill-only request ends its prefill phase with its KV pinned
    pinned_block_ids: tuple[int, ...] = ()
    # on the first token of a prompt computed here: (seconds queued, seconds computing)
    prefill_timing: tuple[float, float] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose prefill the prefix cache skipped (where it ran)


@dataclass(frozen=True, kw_only=True)
class PrefillResult:
    """The outcome of ``prefill``: the first token and where the prompt's KV sits.

    If ``finish_reason`` is set the request already ended at its first token (EOS or
    ``max_tokens == 1``); its blocks were freed and ``block_ids`` is empty. Otherwise the
    blocks stay pinned until ``release(request_id)``.
    """

    request_id: str
    first_token: int
    block_ids: tuple[int, ...]
    num_tokens: int
    first_text: str
    finish_reason: FinishReason | None = None
    first_logprobs: TokenLogprobs | None = None
    queue_s: float = 0.0  # admitted -> first prompt chunk scheduled
    compute_s: float = 0.0  # first prompt chunk -> first token
    num_cached_tokens: int = 0  # prompt tokens whose prefill the prefix cache skipped

    def final_output(self) -> RequestOutput:
        """The whole request's one output, for a request that ended at its first token."""
        return RequestOutput(
            request_id=self.request_id,
            token_ids=(self.first_token,),
            text=self.first_text,
            finished=True,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.num_tokens,
            num_output_tokens=1,
            logprobs=(self.first_logprobs,) if self.first_logprobs is not None else (),
            num_cached_tokens=self.num_cached_tokens,
        )

    @classmethod
    def from_output(cls, output: RequestOutput) -> PrefillResult:
        """Build from the final output of a prefill-only request."""
        return cls(
            request_id=output.request_id,
            first_token=output.token_ids[0],
            block_ids=output.pinned_block_ids,
            num_tokens=output.num_prompt_tokens,
            first_text=output.text,
            finish_reason=output.finish_reason,
            first_logprobs=output.logprobs[0] if output.logprobs else None,
            queue_s=output.prefill_timing[0] if output.prefill_timing else 0.0,
            num_cached_tokens=output.num_cached_tokens,
            compute_s=output.prefill_timing[1] if output.prefill_timing else 0.0,
        )


@dataclass(frozen=True, kw_only=True)
class KVReport:
    """One engine's KV accounting, checked: ``free + cached + in_use == total`` and every block
    in use held by a live request (running, waiting, pinned for export or reserved for a
    transfer), exactly as often as its reference count says. ``problems`` is empty when
    both hold."""

    role: Role
    num_total_blocks: int
    num_free_blocks: int  # empty (not counting cached ones)
    num_cached_blocks: int  # evictable, keeping a cached prefix
    num_in_use_blocks: int
    num_pinned_blocks: int  # exported, waiting for their consumer
    num_reserved_blocks: int  # reserved for KV on its way here
    num_requests: int  # running or waiting
    num_pinned_requests: int
    num_reserved_requests: int
    oldest_pinned_s: float | None  # age of the oldest export still pinned
    oldest_reserved_s: float | None
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    role: Role
    num_total_blocks: int
    num_free_blocks: int
    num_pinned_blocks: int
    num_reserved_blocks: int
    num_running: int
    num_waiting: int
    block_size: int
    num_preemptions: int  # since start
    median_step_ms: float  # median time of the last 64 steps that ran the model
    num_decoding: int = 0  # requests that decode here (whole or decode requests), waiting or running
    num_queued_prompt_tokens: int = 0  # prompt tokens admitted or waiting, not yet computed
    num_cached_blocks: int = 0  # evictable blocks keeping a cached prefix (counted in num_free_blocks)
    prefix_query_tokens: int = 0  # since start: prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # since start: ... whose KV was found there
    num_evictions: int = 0  # since start: cached blocks evicted to make room
    spec_drafts: int = 0  # since start: verified steps that carried speculative proposals
    spec_draft_tokens: int = 0  # since start: tokens proposed
    spec_accepted_tokens: int = 0  # since start: proposed tokens accepted
    tensor_parallel_size: int = 1  # ranks the model is split over
    tp_all_reduce_s: float = 0.0  # since start: rank 0's seconds in all-reduces (and waiting for the others)


class RoleError(RuntimeError):
    """The engine's current role does not accept this kind of request."""


class RankLostError(RuntimeError):
    """A rank of a tensor-parallel engine is gone: the group cannot step again (its replica is
    replaced: ``EngineCore.health_problem``)."""
