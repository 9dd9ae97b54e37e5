"""Engine benchmark: ``python -m bench.engine`` (docs/benchmarks/engine.md: the block between its markers).

For each torch thread count (1 and 2), in a fresh subprocess so peak RSS is per run:
  * memory-bandwidth floor of one decode step: float32 weight bytes / ``torch.mv``
    bandwidth over a 512 MB matrix at the same thread count;
  * batch-1 decode step at a 128-token context (median of 60 steps): ours, and one bare
    transformers forward step with its own cache (sdpa), measured in alternating rounds
    with the ``torch.mv`` bandwidth (the machine's speed drifts); transformers
    ``generate`` end to end;
  * 32 concurrent requests (128 prompt + 64 new tokens): our aggregate tokens/s and
    transformers' ``generate_batch`` (its continuous batching) on the same requests;
  * one 2,048-token prefill: ours and one transformers forward pass (last-token logits);
  * peak RSS of our part (model, 512 MB KV pool, the runs above), before transformers loads.

Ratios: decode step vs the floor and vs transformers; 32-concurrent decode-phase tokens/s
vs our batch-1 tokens/s; 32-concurrent end-to-end tokens/s vs ``generate_batch`` end to
end; prefill vs the forward pass (interleaved runs, medians).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.host import worker_json
from bench.report import cells, command_line, first_paragraph, table, template, write_json, write_page
from workloads.corpus import CORPUS

NUM_STEPS = 60
ROUNDS = 6  # alternating rounds of the decode-step comparison
CONTEXT = 128
NUM_CONCURRENT = 32
NEW_TOKENS = 64
PREFILL_LEN = 2048


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def corpus_ids(tokenizer, num_tokens: int, offset: int = 0) -> list[int]:
    ids = tokenizer(CORPUS + "\n\n" + CORPUS, add_special_tokens=False)["input_ids"]
    return list(ids[offset : offset + num_tokens])


@torch.inference_mode()
def interleaved_decode_steps(core, model, prompt: list[int], rounds: int = ROUNDS) -> dict[str, float]:
    """Batch-1 decode step, ours and one bare transformers forward step with its own cache
    (sdpa), and the ``torch.mv`` bandwidth, measured in alternating rounds: the machine's
    speed drifts by tens of percent within minutes, and the ratios compare like with like.
    Both contexts start at ``len(prompt)`` and grow by one per step."""
    from transformers import DynamicCache

    from engine.params import GenerationRequest, SamplingParams

    per_round = NUM_STEPS // rounds
    core.add_request(
        GenerationRequest("b1", tuple(prompt), SamplingParams(max_tokens=NUM_STEPS + 2, temperature=0, ignore_eos=True))
    )
    core.step()  # prefill
    core.step()  # first decode step (warm-up)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1:].argmax(-1)
    out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)  # warm-up
    token = out.logits[:, -1:].argmax(-1)
    matrix, vector = torch.randn(16384, 8192), torch.randn(8192)  # 512 MiB float32
    torch.mv(matrix, vector)
    ours, hf, mv = [], [], []
    for _ in range(rounds):
        for _ in range(per_round):
            start = time.perf_counter()
            core.step()
            ours.append(time.perf_counter() - start)
        for _ in range(per_round):
            start = time.perf_counter()
            out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1:].argmax(-1)
            hf.append(time.perf_counter() - start)
        for _ in range(3):
            start = time.perf_counter()
            torch.mv(matrix, vector)
            mv.append(time.perf_counter() - start)
    while core.has_work():
        core.step()
    return {
        "our_decode_step_ms": statistics.median(ours) * 1e3,
        "hf_decode_step_ms": statistics.median(hf) * 1e3,
        "mv_bandwidth_bytes_per_s": matrix.numel() * matrix.element_size() / statistics.median(mv),
    }


@torch.inference_mode()
def hf_generate_tokens_per_s(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
    seconds = _median_time(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs), 2)
    return NEW_TOKENS / seconds


def our_concurrent(core, prompts: list[list[int]]) -> dict[str, float]:
    from engine.params import GenerationRequest, SamplingParams

    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(GenerationRequest(f"c{i}", tuple(p), sp))
    decode_tokens, decode_s, total_tokens = 0, 0.0, 0
    start = time.perf_counter()
    while core.has_work():
        step_start = time.perf_counter()
        outputs = core.step()
        elapsed = time.perf_counter() - step_start
        total_tokens += len(outputs)
        if core.stats().num_running == len(prompts) and all(o.num_output_tokens > 1 for o in outputs):
            decode_tokens += len(outputs)
            decode_s += elapsed
    wall = time.perf_counter() - start
    return {"end_to_end_tokens_per_s": total_tokens / wall, "decode_tokens_per_s": decode_tokens / decode_s}


@torch.inference_mode()
def hf_generate_batch_tokens_per_s(model, prompts: list[list[int]]) -> float:
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=config)
    wall = time.perf_counter() - start
    return sum(len(r.generated_tokens) for r in results.values()) / wall


def prefill_pair_s(core, model, prompt: list[int], repeats: int = 3) -> tuple[float, float]:
    """Our prefill and one transformers forward over the same tokens, interleaved (ABAB)."""
    from engine.params import GenerationRequest, SamplingParams

    ids = torch.tensor([prompt])
    ours, theirs = [], []
    for i in range(repeats + 1):
        core.add_request(GenerationRequest(f"p{i}", tuple(prompt), SamplingParams(max_tokens=1, temperature=0)))
        start = time.perf_counter()
        core.step()
        ours.append(time.perf_counter() - start)
        with torch.inference_mode():
            start = time.perf_counter()
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
            theirs.append(time.perf_counter() - start)
    return statistics.median(ours[1:]), statistics.median(theirs[1:])  # the first pair warms up


def worker(threads: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.loader import ModelSpec, load_model

    ours = load_model(ModelSpec())
    tok = ours.tokenizer
    core = EngineCore(ours, EngineConfig(max_model_len=4096, kv_cache_bytes=512 << 20, max_num_batched_tokens=4096))
    prompt = corpus_ids(tok, CONTEXT)
    prompts = [corpus_ids(tok, CONTEXT, offset=11 * i) for i in range(NUM_CONCURRENT)]
    result: dict[str, float] = {"threads": threads}
    concurrent = our_concurrent(core, prompts)
    result["our_32_end_to_end_tokens_per_s"] = concurrent["end_to_end_tokens_per_s"]
    result["our_32_decode_tokens_per_s"] = concurrent["decode_tokens_per_s"]
    result["our_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    reference = load_model(ModelSpec())
    reference.model.generation_config.eos_token_id = None
    # the tied embedding / LM head counted once: the bytes one decode step must read
    weight_bytes = sum(p.numel() * p.element_size() for p in reference.model.parameters())
    steps = interleaved_decode_steps(core, reference.model, prompt)
    result["our_decode_step_ms"] = steps["our_decode_step_ms"]
    result["hf_decode_step_ms"] = steps["hf_decode_step_ms"]
    result["hf_generate_tokens_per_s"] = hf_generate_tokens_per_s(reference.model, prompt)
    result["hf_generate_batch_32_tokens_per_s"] = hf_generate_batch_tokens_per_s(reference.model, prompts)
    ours_s, hf_s = prefill_pair_s(core, reference.model, corpus_ids(tok, PREFILL_LEN))
    result["our_prefill_2048_s"], result["hf_prefill_2048_s"] = ours_s, hf_s

    bandwidth = steps["mv_bandwidth_bytes_per_s"]
    result["weight_bytes"] = weight_bytes
    result["mv_bandwidth_gb_per_s"] = bandwidth / 1e9
    result["bandwidth_floor_step_ms"] = weight_bytes / bandwidth * 1e3
    return result


def ratios(r: dict[str, float]) -> dict[str, float]:
    batch1_tokens_per_s = 1e3 / r["our_decode_step_ms"]
    return {
        "step_vs_bandwidth_floor": r["our_decode_step_ms"] / r["bandwidth_floor_step_ms"],
        "step_vs_hf_step": r["our_decode_step_ms"] / r["hf_decode_step_ms"],
        "batch32_vs_batch1": r["our_32_decode_tokens_per_s"] / batch1_tokens_per_s,
        "batch32_vs_hf_generate_batch": r["our_32_end_to_end_tokens_per_s"] / r["hf_generate_batch_32_tokens_per_s"],
        "prefill_vs_hf_forward": r["our_prefill_2048_s"] / r["hf_prefill_2048_s"],
    }


TARGETS = {
    "step_vs_bandwidth_floor": ("<=", 1.3),
    "step_vs_hf_step": ("<=", 1.1),
    "batch32_vs_batch1": (">=", 6.0),
    "batch32_vs_hf_generate_batch": (">=", 1.5),
    "prefill_vs_hf_forward": ("<=", 1.1),
}


ROWS = (  # the figures' table: label, a run's figure (``report.cells``)
    ("mv bandwidth (GB/s, 512 MB matrix)", "{mv_bandwidth_gb_per_s:.1f}"),
    ("bandwidth floor of one step (ms)", "{bandwidth_floor_step_ms:.1f}"),
    ("our batch-1 decode step, 128 ctx (ms, median of 60, interleaved)", "{our_decode_step_ms:.1f}"),
    ("transformers forward step with cache (ms)", "{hf_decode_step_ms:.1f}"),
    ("transformers generate, batch 1 (tokens/s)", "{hf_generate_tokens_per_s:.1f}"),
    ("ours, 32 concurrent, end to end (tokens/s)", "{our_32_end_to_end_tokens_per_s:.1f}"),
    ("ours, 32 concurrent, decode steps only (tokens/s)", "{our_32_decode_tokens_per_s:.1f}"),
    ("transformers generate_batch, same 32 (tokens/s)", "{hf_generate_batch_32_tokens_per_s:.1f}"),
    ("our 2,048-token prefill (s)", "{our_prefill_2048_s:.2f}"),
    ("transformers forward, 2,048 tokens (s)", "{hf_prefill_2048_s:.2f}"),
    ("peak RSS of our engine (MB, 512 MB KV pool, before transformers runs)", "{our_peak_rss_mb:.0f}"),
)


def render(summary: dict) -> list[str]:
    """The generated block of engine.md, from engine.json: the figures and the ratios against
    their targets, per thread count."""
    runs = summary["runs"]
    threads = [f"{r['threads']} thread(s)" for r in runs]
    lines = [
        f"Command: `{summary['command']}` (SmolLM2-135M-Instruct, float32, CPU; each thread count in its own process).",
        "",
        *table(["metric", *threads], [[label, *(cells(f, r) for r in runs)] for label, f in ROWS]),
        "",
    ]
    rows = []
    for name, (op, bound) in TARGETS.items():
        values = [ratios(r)[name] for r in runs]
        met = [value <= bound if op == "<=" else value >= bound for value in values]
        rows.append([name, f"{op} {bound}", *(f"{v:.2f} {'ok' if ok else 'MISSED'}" for v, ok in zip(values, met))])
    return lines + table(["ratio", "target", *threads], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.engine", description=first_paragraph(__doc__))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="docs/benchmarks", help="folder for engine.json and engine.md")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    runs = []
    for threads in args.threads:
        print(f"running with {threads} torch thread(s)...", file=sys.stderr, flush=True)
        runs.append(worker_json("bench.engine", "--worker", str(threads)))
    summary = {"command": command_line("bench.engine", argv), "runs": [{**r, "ratios": ratios(r)} for r in runs]}
    write_json(Path(args.out) / "engine.json", summary)
    write_page(
        Path(args.out) / "engine.md", "bench.engine", render(summary), template("bench.engine", "# Engine benchmark")
    )


if __name__ == "__main__":
    main()
