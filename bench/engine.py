"""Engine benchmark: ``python -m bench.engine`` (docs/benchmarks/engine.md, the block between its markers).

Our engine against transformers on the same model, per torch thread count in a fresh process: the batch-1 decode step
against the memory-bandwidth floor, 32 concurrent requests, a 2,048-token prefill, and our peak RSS."""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from bench.host import engine_core, seconds, timed, worker_json
from bench.report import arguments, cells, command_line, publish, table
from engine.params import GenerationRequest, SamplingParams
from workloads.corpus import CORPUS

NUM_STEPS = 60
ROUNDS = 6  # alternating rounds of the decode-step comparison
CONTEXT = 128
NUM_CONCURRENT = 32
NEW_TOKENS = 64
PREFILL_LEN = 2048
TARGETS = {  # ratio: its target, and its value in one run
    "step_vs_bandwidth_floor": ("<=", 1.3, lambda r: r["our_decode_step_ms"] / r["bandwidth_floor_step_ms"]),
    "step_vs_hf_step": ("<=", 1.1, lambda r: r["our_decode_step_ms"] / r["hf_decode_step_ms"]),
    "batch32_vs_batch1": (">=", 6.0, lambda r: r["our_32_decode_tokens_per_s"] / (1e3 / r["our_decode_step_ms"])),
    "batch32_vs_hf_generate_batch": (
        ">=", 1.5, lambda r: r["our_32_end_to_end_tokens_per_s"] / r["hf_generate_batch_32_tokens_per_s"]),
    "prefill_vs_hf_forward": ("<=", 1.1, lambda r: r["our_prefill_2048_s"] / r["hf_prefill_2048_s"]),
}  # fmt: skip
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


def corpus_ids(tokenizer, num_tokens: int, offset: int = 0) -> list[int]:
    ids = tokenizer(CORPUS + "\n\n" + CORPUS, add_special_tokens=False)["input_ids"]
    return list(ids[offset : offset + num_tokens])


def greedy_request(request_id: str, prompt: Sequence[int], max_tokens: int, ignore_eos: bool = True):
    """A greedy request (the benchmarks' every request), by default to exactly ``max_tokens`` tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    return GenerationRequest(request_id, tuple(prompt), params)


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step reads: each parameter once, but an untied input embedding (one row per token)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    embedding = model.get_input_embeddings().weight
    if model.get_output_embeddings().weight is not embedding:
        total -= embedding.numel() * embedding.element_size()
    return total


def drain(core) -> None:
    while core.has_work():
        core.step()


def prefilled(core, requests, warm: int = 0) -> None:
    """Admit ``requests``, step until every one decodes, then ``warm`` decode steps."""
    for request in requests:
        core.add_request(request)
    while core.stats().num_queued_prompt_tokens:
        core.step()
    for _ in range(warm):
        core.step()


@torch.inference_mode()
def interleaved_decode_steps(core, model, prompt: list[int]) -> dict[str, float]:
    """Batch-1 decode step, ours and transformers', and ``torch.mv`` bandwidth, in alternating rounds."""
    from transformers import DynamicCache

    prefilled(core, [greedy_request("b1", prompt, NUM_STEPS + 2)], warm=1)  # one decode step to warm up
    cache, token = DynamicCache(config=model.config), [torch.tensor([prompt])]

    def hf_step() -> None:
        out = model(input_ids=token[0], past_key_values=cache, use_cache=True, logits_to_keep=1)
        token[0] = out.logits[:, -1:].argmax(-1)

    hf_step()  # the prompt
    hf_step()  # warm-up
    matrix, vector = torch.randn(16384, 8192), torch.randn(8192)  # 512 MiB float32
    torch.mv(matrix, vector)
    ours, hf, mv = [], [], []
    for _ in range(ROUNDS):
        ours += [seconds(core.step) for _ in range(NUM_STEPS // ROUNDS)]
        hf += [seconds(hf_step) for _ in range(NUM_STEPS // ROUNDS)]
        mv += [seconds(lambda: torch.mv(matrix, vector)) for _ in range(3)]
    drain(core)
    return {"our_decode_step_ms": statistics.median(ours) * 1e3, "hf_decode_step_ms": statistics.median(hf) * 1e3,
            "mv_bandwidth_bytes_per_s": matrix.numel() * matrix.element_size() / statistics.median(mv)}  # fmt: skip


@torch.inference_mode()
def hf_generation(model, prompts: list[list[int]]) -> dict[str, float]:
    """transformers ``generate`` on the first prompt (median of 2) and ``generate_batch`` on all, tokens/s."""
    from transformers import GenerationConfig

    ids = torch.tensor(prompts[:1])
    kwargs = dict(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
    generate = lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)  # noqa: E731
    one_s = statistics.median(seconds(generate) for _ in range(2))
    config = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    results, batch_s = timed(lambda: model.generate_batch(inputs=prompts, generation_config=config))
    batch_tokens = sum(len(r.generated_tokens) for r in results.values())
    return {"hf_generate_tokens_per_s": NEW_TOKENS / one_s, "hf_generate_batch_32_tokens_per_s": batch_tokens / batch_s}


def worker(threads: int) -> dict[str, float]:
    """Every figure of one thread count, in this process: ours first (peak RSS before transformers loads)."""
    from engine.loader import ModelSpec, load_model

    core = engine_core(threads, max_model_len=4096, kv_cache_bytes=512 << 20, max_num_batched_tokens=4096)
    prompts = [corpus_ids(core.tokenizer, CONTEXT, offset=11 * i) for i in range(NUM_CONCURRENT)]
    for i, prompt in enumerate(prompts):  # tokens/s end to end, and over the steps where every request decodes
        core.add_request(greedy_request(f"c{i}", prompt, NEW_TOKENS))
    decode_tokens, decode_s, total_tokens, start = 0, 0.0, 0, time.perf_counter()
    while core.has_work():
        outputs, elapsed = timed(core.step)
        total_tokens += len(outputs)
        if core.stats().num_running == len(prompts) and all(o.num_output_tokens > 1 for o in outputs):
            decode_tokens, decode_s = decode_tokens + len(outputs), decode_s + elapsed
    result = {"threads": threads, "our_32_end_to_end_tokens_per_s": total_tokens / (time.perf_counter() - start),
              "our_32_decode_tokens_per_s": decode_tokens / decode_s,
              "our_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # fmt: skip
    reference = load_model(ModelSpec()).model
    reference.generation_config.eos_token_id = None
    result |= interleaved_decode_steps(core, reference, prompts[0]) | hf_generation(reference, prompts)
    long_prompt = corpus_ids(core.tokenizer, PREFILL_LEN)
    ids, ours, theirs = torch.tensor([long_prompt]), [], []
    with torch.inference_mode():  # our prefill and a transformers forward, interleaved (the first pair warms up)
        for i in range(4):
            core.add_request(greedy_request(f"p{i}", long_prompt, 1, ignore_eos=False))
            ours.append(seconds(core.step))
            theirs.append(seconds(lambda: reference(input_ids=ids, use_cache=False, logits_to_keep=1)))
    weight_bytes, bandwidth = decode_weight_bytes(reference), result.pop("mv_bandwidth_bytes_per_s")
    prefill = {"our_prefill_2048_s": statistics.median(ours[1:]), "hf_prefill_2048_s": statistics.median(theirs[1:])}
    return result | prefill | {"weight_bytes": weight_bytes, "mv_bandwidth_gb_per_s": bandwidth / 1e9,
                               "bandwidth_floor_step_ms": weight_bytes / bandwidth * 1e3}  # fmt: skip


def ratios(run: dict[str, float]) -> dict[str, float]:
    return {name: value(run) for name, (_, _, value) in TARGETS.items()}


def render(summary: dict) -> list[str]:
    runs = summary["runs"]
    threads = [f"{r['threads']} thread(s)" for r in runs]
    rows = []
    for name, (op, bound, _) in TARGETS.items():
        values = [ratios(r)[name] for r in runs]
        met = [value <= bound if op == "<=" else value >= bound for value in values]
        rows.append([name, f"{op} {bound}", *(f"{v:.2f} {'ok' if ok else 'MISSED'}" for v, ok in zip(values, met))])
    figures = table(["metric", *threads], [[label, *(cells(f, r) for r in runs)] for label, f in ROWS])
    setup = "(SmolLM2-135M-Instruct, float32, CPU; each thread count in its own process)"
    return [f"Command: `{summary['command']}` {setup}.", "", *figures, "", *table(["ratio", "target", *threads], rows)]


def main(argv: list[str] | None = None) -> None:
    parser = arguments("bench.engine", __doc__, "docs/benchmarks", "folder for engine.json and engine.md")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    runs = []
    for threads in args.threads:
        print(f"running with {threads} torch thread(s)...", file=sys.stderr, flush=True)
        runs.append(worker_json("bench.engine", "worker", threads))
    summary = {"command": command_line("bench.engine", argv), "runs": [{**r, "ratios": ratios(r)} for r in runs]}
    publish(args.out, "engine", "bench.engine", summary, render(summary), "# Engine benchmark")


if __name__ == "__main__":
    main()
