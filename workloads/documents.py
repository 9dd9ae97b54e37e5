"""Chat prompts whose texts do not repeat themselves, for speculative decoding's benchmark.

``workloads.corpus`` repeats each paragraph and its code prompts repeat one function: prompt
lookup would predict them too well. These come from the Python standard library of the
running interpreter (no download): functions of its modules to edit and return whole
(``edit``: the answer mostly copies the prompt), sections of its language reference to
summarize (``summarization``), and short questions (``chatbot``).
"""

from __future__ import annotations

import colorsys
import difflib
import heapq
import inspect
import statistics
import textwrap

from workloads.corpus import CHAT_QUESTIONS

EDIT_SOURCES = (
    textwrap.dedent,
    colorsys.rgb_to_hls,
    statistics.mode,
    difflib.get_close_matches,
    statistics.quantiles,
    heapq.nsmallest,
)
SUMMARY_TOPICS = ("exceptions", "assert", "while", "try", "with", "for")
SUMMARY_CHARS = 1500  # a section cut at the paragraph that crosses this length
MORE_QUESTIONS = (
    "Why is the sky blue?",
    "Give me three tips for writing clear emails.",
    "What does a compiler do?",
    "Describe a good breakfast.",
)
WORKLOADS = ("edit", "summarization", "chatbot")


def edit_message(i: int) -> str:
    function = EDIT_SOURCES[i % len(EDIT_SOURCES)]
    name = function.__name__
    source = inspect.getsource(function)
    return (
        f"Rename the function `{name}` to `{name}_v2` and return the complete code, otherwise unchanged."
        f"\n\n```python\n{textwrap.dedent(source)}```"
    )


def summary_message(i: int) -> str:
    from pydoc_data.topics import topics

    text, kept = topics[SUMMARY_TOPICS[i % len(SUMMARY_TOPICS)]], []
    for paragraph in text.split("\n\n"):
        kept.append(paragraph)
        if sum(map(len, kept)) >= SUMMARY_CHARS:
            break
    return "Summarize the following text in a few sentences.\n\n" + "\n\n".join(kept)


def chat_message(i: int) -> str:
    questions = CHAT_QUESTIONS + MORE_QUESTIONS
    return questions[i % len(questions)]


def messages(workload: str, i: int) -> list[dict[str, str]]:
    """The ``i``-th prompt of ``workload`` as one user message."""
    make = {"edit": edit_message, "summarization": summary_message, "chatbot": chat_message}[workload]
    return [{"role": "user", "content": make(i)}]
