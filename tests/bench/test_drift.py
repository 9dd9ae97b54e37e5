"""``bench.drift.summarize``: the range and the largest change within a window."""

from __future__ import annotations

import pytest

from bench.drift import SHAPES, summarize


def _sample(t: float, seconds: float) -> dict:
    return {"t": t, **dict.fromkeys(SHAPES, seconds)}


def test_largest_change_counts_only_samples_within_the_window() -> None:
    samples = [_sample(0, 0.050), _sample(100, 0.060), _sample(250, 0.048), _sample(700, 0.080)]
    row = summarize(samples, window_s=300)["decode batch 1"]
    assert row["min_s"] == 0.048 and row["max_s"] == 0.080
    assert row["max_over_min"] == pytest.approx(0.080 / 0.048)
    assert row["largest_change_within_window"] == pytest.approx(0.060 / 0.048 - 1)  # 0.080 is 450 s after
    assert row["median_s"] == pytest.approx(0.055)
