"""Request traces for the simulator: lengths and arrival times read from a file, checked.

Two formats, told apart by their first line:

* **Azure CSV** (the Azure LLM inference 2023 traces released with the Splitwise paper):
  ``TIMESTAMP,ContextTokens,GeneratedTokens``, a wall-clock timestamp per request.
* **JSONL**, one object per line: ``arrival_s`` (or ``sent``, a benchmark record's send time),
  ``prompt_tokens``, and ``max_tokens`` or ``output_tokens`` (the rows ``workloads.load_trace``
  reads when they carry ``prompt_tokens``; a row with prompt text alone has no length here).

Arrivals are made relative to the first request and must not go backwards; lengths are
positive integers. Anything else raises ``TraceError`` naming the file and line.
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from pathlib import Path

from planner.sim_types import SimRequest

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file and, where one is at fault, the line."""

    def __init__(self, path: str | Path, message: str, line: int | None = None) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")


def read_trace(path: str | Path) -> list[SimRequest]:
    """The requests of the trace at ``path`` in arrival order, the first arriving at 0."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(path, f"cannot read the trace: {exc}") from None
    lines = text.splitlines()
    first = next((line.strip() for line in lines if line.strip()), "")
    if first.startswith("{"):
        rows = _jsonl_rows(path, lines)
    elif "," in first and not first[0].isdigit():
        rows = _csv_rows(path, lines)
    else:
        raise TraceError(path, f"not an Azure CSV trace ({','.join(AZURE_COLUMNS)}) nor JSONL", 1 if lines else None)
    requests = list(_checked(path, rows))
    if not requests:
        raise TraceError(path, "the trace holds no request")
    return requests


def _csv_rows(path: Path, lines: list[str]) -> Iterator[tuple[int, float, object, object]]:
    reader = csv.reader(lines)
    header = [name.strip() for name in next(reader)]
    if missing := [name for name in AZURE_COLUMNS if name not in header]:
        raise TraceError(path, f"missing column(s) {', '.join(missing)} (have {', '.join(header)})", 1)
    at = [header.index(name) for name in AZURE_COLUMNS]
    for number, row in enumerate(reader, 2):
        if not row or not "".join(row).strip():
            continue
        if len(row) != len(header):
            raise TraceError(path, f"{len(row)} fields, the header has {len(header)}", number)
        stamp, prompt, output = (row[i].strip() for i in at)
        yield number, _timestamp(path, stamp, number), prompt, output


def _timestamp(path: Path, text: str, number: int) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise TraceError(path, f"TIMESTAMP {text!r} is neither a date-time nor seconds", number) from None


def _jsonl_rows(path: Path, lines: list[str]) -> Iterator[tuple[int, float, object, object]]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(path, f"not JSON: {exc.msg}", number) from None
        if not isinstance(row, dict):
            raise TraceError(path, "a JSON object per line expected", number)
        time_key = next((k for k in ("arrival_s", "sent") if k in row), None)
        output_key = next((k for k in ("max_tokens", "output_tokens") if k in row), None)
        if time_key is None or output_key is None or "prompt_tokens" not in row:
            raise TraceError(path, "needs arrival_s (or sent), prompt_tokens and max_tokens (or output_tokens)", number)
        try:
            arrival = float(row[time_key])
        except (TypeError, ValueError):
            raise TraceError(path, f"{time_key} {row[time_key]!r} is not a number", number) from None
        yield number, arrival, row["prompt_tokens"], row[output_key]


def _length(path: Path, name: str, value: object, number: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
        raise TraceError(path, f"{name} {value!r} is not a positive integer", number)
    if (length := int(value)) < 1:
        raise TraceError(path, f"{name} is {length}: a request has at least one token", number)
    return length


def _checked(path: Path, rows: Iterable[tuple[int, float, object, object]]) -> Iterator[SimRequest]:
    start = previous = None
    for number, arrival, prompt, output in rows:
        if previous is not None and arrival < previous:
            raise TraceError(path, f"arrives {previous - arrival:.6f} s before the line above (out of order)", number)
        start = arrival if start is None else start
        previous = arrival
        yield SimRequest(arrival - start, _length(path, "prompt tokens", prompt, number),
                         _length(path, "output tokens", output, number))  # fmt: skip


def scale_rate(requests: Sequence[SimRequest], k: int, seed: int = 0, jitter_s: float = 1.0) -> list[SimRequest]:
    """The rate times ``k``: each request replayed ``k`` times at its own arrival, every copy but
    the first moved by a uniform jitter below ``jitter_s``, so bursts keep their shape and length."""
    if k < 1:
        raise ValueError(f"rate scale must be >= 1, got {k}")
    rng = random.Random(seed)
    copies = [
        SimRequest(r.arrival_s + (rng.random() * jitter_s if copy else 0.0), r.prompt_tokens, r.output_tokens)
        for r in requests
        for copy in range(k)
    ]
    return sorted(copies, key=lambda r: r.arrival_s)


def window(requests: Sequence[SimRequest], start_s: float, duration_s: float | None) -> list[SimRequest]:
    """The requests arriving in [start_s, start_s + duration_s), shifted to start at 0."""
    end = float("inf") if duration_s is None else start_s + duration_s
    return [SimRequest(r.arrival_s - start_s, r.prompt_tokens, r.output_tokens)
            for r in requests if start_s <= r.arrival_s < end]  # fmt: skip
