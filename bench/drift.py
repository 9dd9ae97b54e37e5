"""How far this machine's own speed moves while nothing else runs: ``python -m bench.drift``.

One engine (as a replica runs it) times the same three shapes every ``--every`` seconds for
``--minutes``, with the hypervisor's steal time; per shape the range, and the largest change
within ``WINDOW_S``: the drift a calibration taken minutes before a measurement cannot see."""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time

from bench.host import cpu_ticks, machine
from bench.report import arguments, command_line, write_json

WINDOW_S = 300.0
SHAPES = ("decode batch 1", "decode batch 8", "prefill 256 tokens")


def sample(engine, prompts) -> dict[str, float]:
    """One timing of each shape (seconds; a decode step: median of 8)."""
    from bench.calibrate_planner import timed_decode, timed_prefill

    decode = {f"decode batch {batch}": timed_decode(engine, prompts, batch, 224) for batch in (1, 8)}
    return decode | {"prefill 256 tokens": timed_prefill(engine, prompts, 1, 256)}


def summarize(samples: list[dict], window_s: float = WINDOW_S) -> dict[str, dict[str, float]]:
    """Per shape: median, min, max, max / min, and the largest change between samples ``window_s`` apart."""
    summary = {}
    for shape in SHAPES:
        seconds, pairs = [s[shape] for s in samples], itertools.combinations(samples, 2)
        changes = [abs(b[shape] - a[shape]) / min(a[shape], b[shape]) for a, b in pairs if b["t"] - a["t"] <= window_s]
        summary[shape] = {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds),
                          "max_over_min": max(seconds) / min(seconds),
                          "largest_change_within_window": max(changes, default=0.0)}  # fmt: skip
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = arguments("bench.drift", __doc__, "docs/benchmarks/drift.json", "the JSON written")
    parser.add_argument("--minutes", type=float, default=12.0)
    parser.add_argument("--every", type=float, default=15.0, help="seconds between samples")
    options = parser.parse_args(argv)
    from bench.calibrate_planner import Prompts, core

    engine = core()
    sample(engine, prompts := Prompts(engine.tokenizer))  # warm-up
    samples, start, steal, started = [], time.monotonic(), cpu_ticks()[2], time.strftime("%Y-%m-%dT%H:%M:%S")
    while time.monotonic() - start < options.minutes * 60:
        began = time.monotonic()
        samples.append({"t": round(began - start, 1), **sample(engine, prompts), "steal_ticks": cpu_ticks()[2] - steal})
        print(json.dumps(samples[-1]), file=sys.stderr, flush=True)
        time.sleep(max(options.every - (time.monotonic() - began), 0.0))
    summary = summarize(samples)
    write_json(options.out, {"command": command_line("bench.drift", argv), "machine": machine(), "started": started,
                             "window_s": WINDOW_S, "summary": summary, "samples": samples})  # fmt: skip
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
