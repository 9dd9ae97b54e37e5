"""Request lengths and arrivals of the workloads, without a tokenizer.

``draw_lengths`` is the one definition of each workload's length distributions: the
token-level generator (``workloads.generators.make_requests``, what ``bench`` sends) and
``planner.simulator.sim_requests`` (what ``planner`` simulates) both draw from it, in the same order from the
same seeded generator, so the same seed gives the same lengths in both. Lengths scale with
the context (``max_model_len``):

* ``chatbot`` (ShareGPT-like): prompt log-normal around a quarter of the context, output
  around 6% of it, prompt + output < context.
* ``code`` (HumanEval-like): prompts around 15% of the context, outputs around 5%.
* ``summarization`` (LongBench-like): a document cut to 70-95% of what the answer leaves,
  answers around 32 tokens.
* ``azure-code`` / ``azure-conversation`` (Splitwise's Azure trace medians): 1,500 prompt /
  13 output and 1,020 / 129, prompts capped to fit the context.

Arrivals (``arrival_times``): a Poisson process, or a gamma process with the same mean rate
and coefficient of variation ``cv`` (burstier for ``cv > 1``); the first request at 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WORKLOADS = ("chatbot", "code", "summarization", "azure-code", "azure-conversation")


@dataclass(frozen=True)
class DrawnLengths:
    prompt_tokens: int
    output_tokens: int
    offset: int  # where the prompt's text starts in its source (token-level prompts only)
    turns: int  # chat turns (chatbot only; 0 otherwise)


def check_workload(name: str) -> None:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")


def _lognormal(rng: np.random.Generator, median: float, sigma: float, low: int, high: int) -> int:
    return min(max(round(median * float(np.exp(rng.normal(0.0, sigma)))), low), max(low, high))


def draw_lengths(name: str, rng: np.random.Generator, context: int) -> DrawnLengths:
    """One request's lengths; ``context`` is ``max_model_len - 1`` (prompt + output stay below it)."""
    offset = int(rng.integers(0, 10_000))
    turns = 0
    if name == "chatbot":
        prompt_len = _lognormal(rng, 0.25 * context, 0.6, 32, int(0.75 * context))
        output = _lognormal(rng, 0.06 * context, 0.5, 8, context - prompt_len)
        turns = int(rng.integers(1, 5))
    elif name == "code":
        prompt_len = _lognormal(rng, 0.15 * context, 0.4, 32, int(0.5 * context))
        output = _lognormal(rng, 0.05 * context, 0.5, 8, context - prompt_len)
    elif name == "summarization":
        output = _lognormal(rng, 32, 0.4, 8, 96)
        prompt_len = int(rng.uniform(0.70, 0.95) * (context - output))
    else:
        prompt_len, output = (1500, 13) if name == "azure-code" else (1020, 129)
        prompt_len = min(prompt_len, context - output)
    return DrawnLengths(prompt_len, output, offset, turns)


def arrival_times(num: int, rate: float, process: str = "poisson", cv: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets (seconds) of ``num`` requests at ``rate`` per second.

    ``poisson``: exponential gaps. ``gamma``: gamma gaps with the same mean and coefficient
    of variation ``cv`` (> 1 is burstier than Poisson).
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = np.random.default_rng(seed)
    if process == "poisson":
        gaps = rng.exponential(1.0 / rate, num)
    elif process == "gamma":
        shape = 1.0 / (cv * cv)
        gaps = rng.gamma(shape, 1.0 / (rate * shape), num)
    else:
        raise ValueError(f"unknown arrival process {process!r} (poisson, gamma)")
    gaps[0] = 0.0
    return list(np.cumsum(gaps))
