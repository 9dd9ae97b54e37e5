"""bench.gpu_engine on the CPU: a row's cells and failure, the bytes a decode step reads, and the
dry run's path for one tiny model (the GPU rows need CUDA, so they say so)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.engine import decode_weight_bytes
from bench.gpu_engine import TINY_SIZES, Row, guarded, run


def test_a_row_prints_its_figures_and_its_ratio_to_the_floor():
    row = Row("llama decode batch 64", 2663.9, "tok/s", 24.02, 0.576, "63 steps")
    assert row.ratio == pytest.approx(24.02 / 0.576)
    assert row.markdown() == "| llama decode batch 64 | 2,664 | tok/s | 24.020 | 0.576 | 41.70 | 63 steps |"
    assert Row("bf16 matmul", 784.33, "TFLOP/s", 1.4).markdown() == "| bf16 matmul | 784.3 | TFLOP/s | 1.400 |  |  |  |"


def test_a_failed_measurement_is_its_row():
    def fails() -> Row:
        raise RuntimeError("CUDA out of memory\nmore detail")

    row = guarded("llama-8B prefill", fails)
    assert row.error == "RuntimeError: CUDA out of memory" and row.value is None
    assert row.markdown() == "| llama-8B prefill | failed: RuntimeError: CUDA out of memory |  |  |  |  |  |"


@pytest.mark.parametrize("tied", [True, False])
def test_a_decode_step_reads_each_weight_once_but_an_untied_input_embedding(tied: bool):
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 4)
    model.head = torch.nn.Linear(4, 10, bias=False)
    if tied:
        model.head.weight = model.embed.weight
    model.get_input_embeddings, model.get_output_embeddings = (lambda: model.embed), (lambda: model.head)
    assert decode_weight_bytes(model) == 40 * 4  # the head's 40 floats; an untied embedding is read by row


def test_the_dry_run_measures_every_row_of_a_tiny_model():
    sizes = dataclasses.replace(TINY_SIZES, models=TINY_SIZES.models[1:], decode_batches=(2,), reps=1, prefill_reps=1)
    rows = {row.name: row for row in run(sizes)}
    assert [name for name, row in rows.items() if row.error] == []
    assert list(rows) == [
        "copy bandwidth",
        "bf16 matmul",
        "tiny-untied dummy weights on cpu",
        "tiny-untied decode batch 2, CUDA graphs, fused kernels",
        "tiny-untied kernels of a decode step, batch 2, CUDA graphs, fused kernels",
        "tiny-untied decode batch 2, CUDA graphs, fused kernels, synchronous steps",
        "tiny-untied decode batch 2, CUDA graphs, fused kernels, cuBLASLt products",
        "tiny-untied decode batch 2, CUDA graphs",
        "tiny-untied kernels of a decode step, batch 2, CUDA graphs",
        "tiny-untied decode batch 2, eager",
        "tiny-untied decode batch 1, CUDA graphs, fused kernels, context 400",
        "tiny-untied decode batch 1, CUDA graphs, context 400",
        "tiny-untied prefill 256 tokens",
        "tiny-untied speculative decode, batch 1",  # the first model's
    ]
    assert rows["tiny-untied decode batch 2, CUDA graphs"].notes == "n/a: CUDA graphs need CUDA"
    assert rows["tiny-untied kernels of a decode step, batch 2, CUDA graphs"].notes == "n/a: CUDA only"
    spec = rows["tiny-untied speculative decode, batch 1"]
    assert (
        spec.unit == "verify steps/s" and " verify steps, " in spec.notes and "proposed tokens accepted" in spec.notes
    )
    decode = rows["tiny-untied decode batch 2, eager"]
    assert decode.unit == "tok/s" and decode.value > 0 and decode.notes.startswith("7 steps, ctx 16-24")
    assert decode.floor_ms > 0 and rows["tiny-untied prefill 256 tokens"].floor_ms > 0
    assert "; with the K/V read (0.0 MB): " in decode.notes  # 2 x 20 tokens x 512 bytes
