"""Prompts to token ids: plain text, token ids, or a chat through the model's template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ChatMessage = Mapping[str, Any]


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase | None,
    prompt: str | Sequence[ChatMessage] | Sequence[int],
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template: str | None = None,
    template_options: Mapping[str, Any] | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """Token ids of a prompt. A text gets the tokenizer's special tokens (a BOS, for a model
    whose tokenizer adds one) with ``add_special_tokens``. A list of ``{"role", "content", ...}``
    dicts uses the chat template (``chat_template``: in place of the tokenizer's; it writes
    any BOS itself), with ``tools`` given to it, and ``template_options``:
    ``apply_chat_template``'s ``add_generation_prompt`` (by default true) or
    ``continue_final_message``, and variables the template reads (e.g. ``enable_thinking``)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer (dummy weights); pass token ids")
        if not prompt:
            raise ValueError("prompt must not be empty")
        return list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
    items = list(prompt)
    if not items:
        raise ValueError("prompt must not be empty")
    if all(isinstance(m, Mapping) for m in items):
        if tokenizer is None or (chat_template or tokenizer.chat_template) is None:
            raise ValueError("messages: this model has no chat template")
        for i, m in enumerate(items):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must have string 'role' and 'content'")
        options = {"add_generation_prompt": True, **(template_options or {})}
        encoded = tokenizer.apply_chat_template(
            items, tools=tools or None, chat_template=chat_template, tokenize=True, **options
        )
        return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        if (negative := next((t for t in items if t < 0), None)) is not None:
            raise ValueError(f"prompt: token ids are non-negative integers, got {negative}")
        return items
    raise ValueError("prompt must be a string, a list of chat messages or a list of token ids")


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """End-of-sequence ids from the generation config and the tokenizer."""
    ids: set[int] = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
