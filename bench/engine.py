"""Engine benchmark: ``python -m bench.engine`` (summary in docs/benchmarks/engine.md).

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
import subprocess
import sys
import time
from pathlib import Path

import torch

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


def report(runs: list[dict[str, float]], command: str) -> str:
    lines = [
        "# Engine benchmark",
        "",
        f"Command: `{command}` (SmolLM2-135M-Instruct, float32, CPU; each thread count in its own process).",
        "",
        "| metric | " + " | ".join(f"{r['threads']} thread(s)" for r in runs) + " |",
        "|---|" + "---|" * len(runs),
    ]
    rows = [
        ("mv bandwidth (GB/s, 512 MB matrix)", "mv_bandwidth_gb_per_s", "{:.1f}"),
        ("bandwidth floor of one step (ms)", "bandwidth_floor_step_ms", "{:.1f}"),
        ("our batch-1 decode step, 128 ctx (ms, median of 60, interleaved)", "our_decode_step_ms", "{:.1f}"),
        ("transformers forward step with cache (ms)", "hf_decode_step_ms", "{:.1f}"),
        ("transformers generate, batch 1 (tokens/s)", "hf_generate_tokens_per_s", "{:.1f}"),
        ("ours, 32 concurrent, end to end (tokens/s)", "our_32_end_to_end_tokens_per_s", "{:.1f}"),
        ("ours, 32 concurrent, decode steps only (tokens/s)", "our_32_decode_tokens_per_s", "{:.1f}"),
        ("transformers generate_batch, same 32 (tokens/s)", "hf_generate_batch_32_tokens_per_s", "{:.1f}"),
        ("our 2,048-token prefill (s)", "our_prefill_2048_s", "{:.2f}"),
        ("transformers forward, 2,048 tokens (s)", "hf_prefill_2048_s", "{:.2f}"),
        ("peak RSS of our engine (MB, 512 MB KV pool, before transformers runs)", "our_peak_rss_mb", "{:.0f}"),
    ]
    for label, key, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(fmt.format(r[key]) for r in runs) + " |")
    lines += ["", "| ratio | target | " + " | ".join(f"{r['threads']} thread(s)" for r in runs) + " |"]
    lines.append("|---|---|" + "---|" * len(runs))
    for name, (op, bound) in TARGETS.items():
        cells = []
        for r in runs:
            value = ratios(r)[name]
            ok = value <= bound if op == "<=" else value >= bound
            cells.append(f"{value:.2f} {'ok' if ok else 'MISSED'}")
        lines.append(f"| {name} | {op} {bound} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + NOTES


NOTES = """
## Reading the numbers

* **The bandwidth-floor target is missed.** The floor divides the weight bytes by the
  bandwidth of `torch.mv` over one 512 MB matrix, but a decode step is a chain of
  matrix-vector products over matrices of 0.4 to 7 MB (and a 113 MB LM head), which this
  machine's BLAS streams at 7 to 24 GB/s depending on shape, layout and call (table in
  `cpu_kernels.md`). The engine runs 4 products per layer instead of 7 (q/k/v and
  gate/up fused, `engine/fused_linear.py`) with column-major `x @ W_t` where that streams
  faster. In a torch-profiler run of 5 batch-1 steps (1 thread, 40 ms a step) the 121
  products took 32 ms a step, about 1.3x the floor by themselves; the other 8 ms are
  eager PyTorch's per-operator cost (norms, RoPE, attention: about 20 operators a layer).
  Tried and not shipped: `torch.compile` of the decoder (after a 2-minute compile on
  2 cores, 46 -> 41 ms, 1.85x the floor); the weights on 2 MB pages (no change); a
  helper thread reading the next layer's weights ahead (45 -> 52 ms: one core already
  takes the memory bandwidth this machine gives, `torch.mv` on 2 threads is no faster
  than on 1); oneDNN for the one-row products too (42.0 -> 50.7 ms). transformers' own
  forward step is further from the floor than ours.
* Steps of two rows or more (batched decode, prefill) multiply through oneDNN on its
  packed copy of the weights (`engine/cpu_matmul.py`, `EngineConfig.cpu_packed_weights`,
  on by default): MKL's few-row products made a 4-sequence step 2.2x a 1-sequence one.
  The copy adds the weights once more to the peak RSS (about 540 MB for this model). Decode
  attention gathers whole KV blocks and groups the query heads that share a KV head
  (`engine/attention.py`).
* "32 concurrent, decode steps only" counts the steps in which all 32 requests decode
  (the aggregate decode rate); "end to end" includes the 32 prompts' prefill and is the
  figure compared with `generate_batch`, which is timed end to end too.
* The decode steps (ours, transformers') and the `torch.mv` bandwidth are measured in 6
  alternating rounds, and the 2,048-token prefill and the transformers forward run
  interleaved (ABAB, first pair dropped), so machine drift hits both sides of each ratio
  alike. The 32-request figures are not interleaved.
* The machine is shared and its speed drifts by tens of percent within minutes: the
  `torch.mv` bandwidth moved between 16 and 24 GB/s on the same day, and the same decode
  step between 46 and 68 ms. Ratios within one run are what this table is for; targets
  close to their limit (batch 32 vs batch 1, prefill vs the forward pass) moved across
  the line between runs.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="docs/benchmarks", help="folder for engine.json and engine.md")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    runs = []
    for threads in args.threads:
        print(f"running with {threads} torch thread(s)...", file=sys.stderr, flush=True)
        proc = subprocess.run(
            [sys.executable, "-m", "bench.engine", "--worker", str(threads)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            sys.exit(proc.stderr)
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = [{**r, "ratios": ratios(r)} for r in runs]
    (out / "engine.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = report(runs, "python -m bench.engine " + " ".join(sys.argv[1:]))
    (out / "engine.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
