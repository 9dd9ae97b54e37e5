"""How far this machine's own speed moves while nothing else runs: ``python -m bench.drift``.

One engine (the default model, one torch thread, as a replica runs it) times the same three
shapes again and again: a batch-1 decode step and a batch-8 decode step (medians of 8 steps)
and one 256-token prefill step, one sample of each every ``--every`` seconds for ``--minutes``
minutes, with the machine's steal time (CPU taken by the hypervisor) in between. The summary
gives, per shape, the range of the samples and the largest change between two samples at
most ``WINDOW_S`` apart: the drift a calibration taken a few minutes before a measurement
cannot see, against the planner check's 15% bound (docs/benchmarks/planner.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

WINDOW_S = 300.0
SHAPES = ("decode batch 1", "decode batch 8", "prefill 256 tokens")


def steal_ticks() -> int:
    """The machine's steal ticks so far (``/proc/stat``, field 8 of the ``cpu`` line)."""
    return int(Path("/proc/stat").read_text().split("\n", 1)[0].split()[8])


def sample(core, prompts) -> dict[str, float]:
    """One timing of each shape (seconds)."""
    from bench.calibrate_planner import _finish, _start_batch, _timed_prefill, _timed_step

    out = {}
    for batch in (1, 8):
        _start_batch(core, prompts, batch, 224, 12)
        core.step()  # the first decode step warms the batch's shapes up
        out[f"decode batch {batch}"] = statistics.median(_timed_step(core) for _ in range(8))
        _finish(core)
    out["prefill 256 tokens"] = _timed_prefill(core, prompts, 1, 256)
    return out


def summarize(samples: list[dict], window_s: float = WINDOW_S) -> dict[str, dict[str, float]]:
    """Per shape: median, min, max, max / min, and the largest relative change (later over
    earlier, either way) between two samples at most ``window_s`` apart."""
    summary = {}
    for shape in SHAPES:
        values = [(s["t"], s[shape]) for s in samples]
        worst = 0.0
        for i, (t0, v0) in enumerate(values):
            for t1, v1 in values[i + 1 :]:
                if t1 - t0 <= window_s:
                    worst = max(worst, abs(v1 - v0) / min(v0, v1))
        seconds = [v for _, v in values]
        summary[shape] = {
            "median_s": statistics.median(seconds),
            "min_s": min(seconds),
            "max_s": max(seconds),
            "max_over_min": max(seconds) / min(seconds),
            "largest_change_within_window": worst,
        }
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.drift", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=12.0)
    parser.add_argument("--every", type=float, default=15.0, help="seconds between samples")
    parser.add_argument("--out", default="docs/benchmarks/drift.json")
    options = parser.parse_args(argv)
    from bench.calibrate_planner import Prompts, _core, _tokenizer
    from bench.host import machine

    core, prompts = _core(), Prompts(_tokenizer())
    sample(core, prompts)  # warm-up
    samples, start, tick = [], time.monotonic(), steal_ticks()
    while time.monotonic() - start < options.minutes * 60:
        began = time.monotonic()
        point = {"t": round(began - start, 1), **sample(core, prompts), "steal_ticks": steal_ticks() - tick}
        samples.append(point)
        print(json.dumps(point), file=sys.stderr, flush=True)
        time.sleep(max(options.every - (time.monotonic() - began), 0.0))
    report = {
        "command": "python -m bench.drift" + "".join(f" {a}" for a in (argv or sys.argv[1:])),
        "machine": machine(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - (time.monotonic() - start))),
        "window_s": WINDOW_S,
        "summary": summarize(samples),
        "samples": samples,
    }
    Path(options.out).write_text(json.dumps(report, indent=1) + "\n")
    for shape, row in report["summary"].items():
        print(
            f"{shape}: median {row['median_s'] * 1e3:.1f} ms, {row['min_s'] * 1e3:.1f}-{row['max_s'] * 1e3:.1f} ms"
            f" (x{row['max_over_min']:.2f}), largest change within {WINDOW_S:.0f} s:"
            f" {row['largest_change_within_window']:.0%}",
        )


if __name__ == "__main__":
    main()
