"""Token-level workloads shaped like DistServe's three and Splitwise's Azure medians.

Every prompt is built from real tokens of the served tokenizer and has exactly the asked
length, so the server sees the intended prompt; requests ask ``ignore_eos`` so outputs
have exactly ``max_tokens`` tokens. Lengths scale with the context (``max_model_len``) and
are drawn from a seeded generator:

* ``chatbot`` (ShareGPT-like): multi-turn conversations through the chat template; prompt
  length log-normal around a quarter of the context, output around 6% of it, and
  prompt + output < context.
* ``code`` (HumanEval-like): short code prompts (around 15% of the context), short outputs
  (around 5%).
* ``summarization`` (LongBench-like): a document cut to a random length near the context
  limit (70-95% of what the answer leaves), short answers (around 32 tokens).
* ``azure-code`` / ``azure-conversation`` (Splitwise's Azure trace medians): 1,500 prompt /
  13 output and 1,020 / 129, prompts capped to fit the context.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from workloads.corpus import CORPUS, PARAGRAPHS
from workloads.lengths import check_workload, draw_lengths

CODE = PARAGRAPHS[5]


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str  # token ids (exact length) or text (from a trace)
    prompt_tokens: int
    max_tokens: int
    arrival_s: float | None = None  # only from a trace


class PromptBuilder:
    """Exact-length prompts from real tokens of one tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._corpus = self.ids(CORPUS)
        self._code = self.ids("\n".join(CODE.replace("merge_sorted", f"merge_sorted_{i}") for i in range(40)))

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _cut(self, source: list[int], length: int, offset: int) -> list[int]:
        start = offset % max(1, len(source) - length)
        out = source[start : start + length]
        while len(out) < length:  # longer than the corpus: wrap around
            out += source[: length - len(out)]
        return out

    def fit(self, head: list[int], body: list[int], tail: list[int], length: int) -> list[int]:
        """``head + body[:room] + tail`` cut to exactly ``length`` tokens."""
        room = length - len(head) - len(tail)
        if room < 0:
            return (head + tail)[-length:]
        return head + self._cut(body, room, 0) + tail

    def summarization(self, length: int, offset: int) -> list[int]:
        head = self.ids("Summarize the following document in a few sentences.\n\n")
        return self.fit(head, self._cut(self._corpus, length, offset), self.ids("\n\nSummary:"), length)

    def code(self, length: int, offset: int) -> list[int]:
        head = self.ids("# Complete the following Python module.\n")
        return self.fit(head, self._cut(self._code, length, offset), self.ids("\ndef "), length)

    def chat(self, length: int, offset: int, turns: int) -> list[int]:
        """A conversation of ``turns`` exchanges through the chat template, then the
        assistant's turn; the history is cut so the whole is ``length`` tokens."""
        messages = []
        for t in range(turns):
            messages.append({"role": "user", "content": PARAGRAPHS[(offset + 2 * t) % len(PARAGRAPHS)]})
            messages.append({"role": "assistant", "content": PARAGRAPHS[(offset + 2 * t + 1) % len(PARAGRAPHS)]})
        messages.append({"role": "user", "content": "Can you say more about that?"})
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            ids = list(ids)
        else:
            ids = self.ids("\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:")
        tail = ids[-24:]  # the last question and the assistant prompt stay whole
        history = ids[:-24]
        if len(history) < length - len(tail):
            history = history + self._corpus
        return history[len(history) - (length - len(tail)) :][: length - len(tail)] + tail


def make_requests(name: str, tokenizer, max_model_len: int, num_requests: int, seed: int = 0) -> list[BenchRequest]:
    """``num_requests`` requests of workload ``name`` for a server with this context (the
    lengths are ``workloads.lengths.draw_lengths``'s, the same ones ``planner.simulator.sim_requests`` draws)."""
    check_workload(name)
    rng = np.random.default_rng(seed)
    builder = PromptBuilder(tokenizer)
    context = max_model_len - 1  # prompt + output must stay below the context
    requests = []
    for _ in range(num_requests):
        drawn = draw_lengths(name, rng, context)
        if name == "chatbot":
            prompt = builder.chat(drawn.prompt_tokens, drawn.offset, turns=drawn.turns)
        elif name == "code":
            prompt = builder.code(drawn.prompt_tokens, drawn.offset)
        else:
            prompt = builder.summarization(drawn.prompt_tokens, drawn.offset)
        assert len(prompt) == drawn.prompt_tokens, (name, len(prompt), drawn.prompt_tokens)
        requests.append(BenchRequest(prompt, drawn.prompt_tokens, drawn.output_tokens))
    return requests


def load_trace(path: str | Path, tokenizer) -> list[BenchRequest]:
    """A JSONL trace: one object per line with ``arrival_s``, ``max_tokens`` and either
    ``prompt`` (text) or ``prompt_tokens`` (a length, built from the corpus)."""
    builder = PromptBuilder(tokenizer)
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        try:
            arrival, max_tokens = float(row["arrival_s"]), int(row["max_tokens"])
            if "prompt" in row:
                text = str(row["prompt"])
                requests.append(BenchRequest(text, len(builder.ids(text)), max_tokens, arrival))
            else:
                length = int(row["prompt_tokens"])
                requests.append(BenchRequest(builder.summarization(length, number), length, max_tokens, arrival))
        except (KeyError, ValueError, TypeError) as exc:
            need = "arrival_s, max_tokens, prompt or prompt_tokens"
            raise ValueError(f"{path}:{number}: {exc!r} (need {need})") from None
    return sorted(requests, key=lambda r: r.arrival_s)


def median_request(requests: list[BenchRequest]) -> BenchRequest:
    """The request with the median prompt length (the Splitwise-style SLO reference)."""
    ordered = sorted(requests, key=lambda r: r.prompt_tokens)
    return ordered[len(ordered) // 2]


# ---- closed-loop multi-turn chat (prefix caching) -----------------------------------------


@dataclass(frozen=True)
class ChatConversation:
    """One conversation of a closed-loop multi-turn chat: the user's text of each turn, fixed
    in advance; the assistant's answers come from the server while it runs. Turn ``t``'s
    request is the whole conversation so far (every earlier user text and answer, then user
    text ``t``), sent when the answer of turn ``t - 1`` has ended, so each prompt carries the
    previous one as its prefix."""

    index: int
    user_texts: tuple[str, ...]
    max_tokens: int  # output tokens per turn (asked with ignore_eos: exactly this many)

    @property
    def num_turns(self) -> int:
        return len(self.user_texts)

    def messages(self, answers: Sequence[str]) -> list[dict[str, str]]:
        """The chat messages of turn ``len(answers)`` (0-based): user/assistant alternating."""
        if len(answers) >= self.num_turns:
            raise ValueError(f"conversation {self.index} has {self.num_turns} turns, got {len(answers)} answers")
        messages = []
        for user, answer in zip(self.user_texts, answers):
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": self.user_texts[len(answers)]})
        return messages


def chat_conversations(
    tokenizer, num_conversations: int = 8, num_turns: int = 5, user_tokens: int = 200, output_tokens: int = 100
) -> list[ChatConversation]:
    """``num_conversations`` conversations of ``num_turns`` turns, deterministic: each user text
    is a tag naming its conversation and turn, then corpus tokens from an offset of its own,
    ``user_tokens`` tokens in all (as token ids; the decoded text re-encodes to about as many).
    No two user texts are equal, so conversations share no prefix beyond the chat template's."""
    builder = PromptBuilder(tokenizer)
    conversations = []
    for c in range(num_conversations):
        texts = []
        for t in range(num_turns):
            head = builder.ids(f"[conversation {c + 1}, turn {t + 1}] ")
            offset = 97 * (c * num_turns + t)  # distinct windows of the corpus
            ids = builder.fit(head, builder._cut(builder._corpus, user_tokens, offset), [], user_tokens)
            texts.append(tokenizer.decode(ids))
        conversations.append(ChatConversation(c, tuple(texts), output_tokens))
    return conversations
