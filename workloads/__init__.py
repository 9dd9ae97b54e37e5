"""The request generators that ``bench/`` sends and ``planner/`` simulates.

``workloads.lengths`` holds the length distributions and arrival processes (no tokenizer);
``workloads.generators`` builds exact-length prompts from real tokens for the served model;
``workloads.corpus`` is the text they are cut from.
"""

from workloads.generators import (
    BenchRequest,
    ChatConversation,
    PromptBuilder,
    chat_conversations,
    load_trace,
    make_requests,
    median_request,
)
from workloads.lengths import WORKLOADS, DrawnLengths, arrival_times, draw_lengths

__all__ = [
    "WORKLOADS",
    "BenchRequest",
    "ChatConversation",
    "DrawnLengths",
    "PromptBuilder",
    "arrival_times",
    "chat_conversations",
    "draw_lengths",
    "load_trace",
    "make_requests",
    "median_request",
]
