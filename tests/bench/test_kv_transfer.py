"""``bench.kv_transfer.push_figures``: a push's tail and one layer's write from its layer timestamps."""

from __future__ import annotations

import pytest

from bench.kv_transfer import push_figures
from kv_transport.base import LayerTiming

# three layers (unix seconds): the forward ends at 1.0, 2.0 and 3.0; each write takes 0.1 s
LAYERS = [LayerTiming(layer=i, compute_end=1.0 + i, posted=1.05 + i, done=1.15 + i) for i in range(3)]


def test_a_pipelined_push_is_timed_from_the_last_layers_compute_end() -> None:
    figures = push_figures("pipelined", LAYERS, pipelined=True)
    assert figures["pipelined_tail_ms"] == pytest.approx(150.0)  # 3.15 - 3.0
    assert figures["pipelined_one_layer_ms"] == pytest.approx(100.0)
    assert figures["pipelined_tail_in_layers"] == pytest.approx(1.5)


def test_a_push_after_the_forward_is_timed_from_the_first_layers_compute_end() -> None:
    figures = push_figures("not_pipelined", LAYERS, pipelined=False)
    assert figures["not_pipelined_tail_ms"] == pytest.approx(2150.0)  # 3.15 - 1.0
    assert figures["not_pipelined_tail_in_layers"] == pytest.approx(21.5)
