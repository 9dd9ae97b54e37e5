"""Incremental detokenization and stop strings.

Text is emitted only when it is final: a delta never ends in an incomplete UTF-8
character (the tokenizer renders one as U+FFFD, so we wait for the next token), and up to
``len(longest stop string) - 1`` characters are held back so that a stop string split
across tokens is never partly streamed.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

# prompt tokens kept as left context, so a token's leading space decodes as it would in place
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """A request's output text, a token at a time; special tokens (e.g. ``<|im_end|>``) have
    no text unless ``skip_special_tokens`` is false (vLLM's field)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (may be empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        # drop what can no longer affect decoding, so each push costs O(1) tokens
        self._ids = self._ids[self._read_offset :]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]


class TextStream:
    """Detokenizes a request's output and cuts it exactly at the first stop string: before it,
    or after it with ``keep_stop`` (vLLM's ``include_stop_str_in_output``)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        prompt_ids: Sequence[int],
        stop: tuple[str, ...],
        keep_stop: bool = False,
        skip_special_tokens: bool = True,
    ):
        self._detok = (
            IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens) if tokenizer is not None else None
        )
        self._stop = stop
        self._keep_stop = keep_stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._emitted = 0

    def push(self, token_id: int) -> tuple[str, bool]:
        """Returns (text to emit now, whether a stop string was hit)."""
        if self._detok is None:
            return "", False
        search_from = max(0, len(self.text) - self._holdback)
        self.text += self._detok.push(token_id)
        # the earliest match (the first listed of those that start there), cut before or after it
        hits = [(i, len(s) if self._keep_stop else 0) for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            start, kept = min(hits, key=lambda hit: hit[0])
            self.text = self.text[: start + kept]
            return self._take(len(self.text)), True
        return self._take(len(self.text) - self._holdback), False

    def flush(self) -> str:
        """The held-back tail, when the request ends for another reason."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
