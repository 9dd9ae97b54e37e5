"""The engine on one GPU: ``python3 -m bench.gpu_engine [--out PATH] [--tiny]``.

The floors (copy bandwidth, bf16 matmul rate), then per model (random bfloat16 weights made on the GPU): decode
tok/s at batch 1 and 64 in each of ``MODES`` against the weights' HBM floor, the graph's replay alone, one step's
kernels by kind, prefill tok/s against the FLOP floor, and for the first model speculative decoding's verify steps.
A failed row says so and the rest go on; ``--tiny``: tiny sizes on the CPU."""

from __future__ import annotations

import gc
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig

from bench.engine import decode_weight_bytes, drain, greedy_request, prefilled
from bench.host import seconds, synchronize
from bench.report import arguments, cells, table, write_json
from engine.config import DEFAULT_CUDA_GRAPH_BATCH_SIZES, EngineConfig, SpeculativeConfig
from engine.core import EngineCore
from engine.loader import LoadedModel, ModelSpec, load_model

LLAMA = dict(num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
LLAMA_1B = LLAMA | dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, tie_word_embeddings=True)
LLAMA_8B = LLAMA | dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, tie_word_embeddings=False)
QWEN3_8B = dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                tie_word_embeddings=False)  # fmt: skip
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=512)  # fmt: skip


@dataclass(frozen=True)
class Sizes:
    device: str
    copy_bytes: int
    matmul_n: int
    reps: int  # timed repetitions of the copy and the matmul (after 3 warm-ups)
    models: tuple[tuple[str, dict], ...]
    decode_batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    prefill_len: int
    prefill_reps: int
    kv_cache_bytes: int
    long_prompt_len: int
    max_model_len: int = 4096


MODELS = (("llama-1B", LLAMA_1B), ("llama-8B", LLAMA_8B), ("qwen3-8B", QWEN3_8B))
GPU_SIZES = Sizes("cuda", 2 << 30, 8192, 10, MODELS, (1, 64), 128, 64, 2048, 3, 4 << 30, 3968)
TINY_MODELS = tuple((f"tiny-{kind}", TINY | {"tie_word_embeddings": kind == "tied"}) for kind in ("tied", "untied"))
TINY_SIZES = Sizes("cpu", 64 << 20, 256, 5, TINY_MODELS, (1, 8), 16, 8, 256, 2, 16 << 20, 400, max_model_len=512)
# cuBLAS's product kernels (nvjet: CUDA 13's), attention, copies; any other kernel is "other"
KERNEL_KINDS = (
    ("gemm", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "splitk", "cublas")),
    ("attention", ("fmha", "flash", "attention", "softmax", "paged")),
    ("copy", ("memcpy", "memset", "index", "gather", "scatter", "cat")),
)
# decode modes (``use_mode``) and their rows' names; the graph replay rows of ``graphs`` keep their first name
MODES = {
    "fused": "CUDA graphs, fused kernels",
    "fused-sync": "CUDA graphs, fused kernels, synchronous steps",
    "fused-lt": "CUDA graphs, fused kernels, cuBLASLt products",
    "graphs": "CUDA graphs",
    "eager": "eager",
}
REPLAY_SUFFIX = {"fused": ", fused kernels", "graphs": ""}
DEFAULT_BLAS = torch.backends.cuda.preferred_blas_library()  # PyTorch's choice, restored after "fused-lt"
HEADER = "\n".join(table("measurement | value | unit | time ms | floor ms | time / floor | notes", []))


@dataclass
class Row:
    """One measurement: ``value`` in ``unit``, its median ``time_ms`` and the ``floor_ms`` it is held to."""

    name: str
    value: float | None = None
    unit: str = ""
    time_ms: float | None = None
    floor_ms: float | None = None
    notes: str = ""
    error: str | None = None
    ratio: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.ratio = self.time_ms / self.floor_ms if self.time_ms is not None and self.floor_ms else None

    def markdown(self) -> str:
        value = "{value:,.0f}" if self.value is not None and abs(self.value) >= 1000 else "{value:.4g}"
        value = "failed: {error}" if self.error else value
        row = f"{{name}} | {value} | {{unit}} | {{time_ms:.3f}} | {{floor_ms:.3f}} | {{ratio:.2f}} | {{notes}}"
        return f"| {cells(row, asdict(self), missing='')} |"


def guarded(name: str, measure: Callable[..., Row], *args: object) -> Row:
    """``measure(*args)``; any error becomes its row, so the others still run."""
    try:
        return measure(*args)
    except Exception as exc:  # a benchmark row reports every failure and goes on
        return error_row(name, exc)


def error_row(name: str, exc: Exception) -> Row:
    return Row(name, error=f"{type(exc).__name__}: {str(exc).partition(chr(10))[0]}"[:300])


def median_ms(fn: Callable[[], object], reps: int, device: str, warmup: int = 3) -> float:
    """Median time of ``fn`` in ms: CUDA events around each call on CUDA, the wall clock on CPU."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device != "cuda":
        return statistics.median(seconds(fn) for _ in range(reps)) * 1e3
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in pairs)


def copy_bandwidth(sizes: Sizes) -> Row:
    src = torch.ones(sizes.copy_bytes, dtype=torch.uint8, device=sizes.device)
    dst = torch.empty_like(src)
    ms, gb = median_ms(lambda: dst.copy_(src), sizes.reps, sizes.device), sizes.copy_bytes / 1e9
    return Row("copy bandwidth", 2 * gb / (ms / 1e3), "GB/s", ms, notes=f"copy_ of {gb:.2f} GB, read + written")


def matmul_flops(sizes: Sizes) -> Row:
    n = sizes.matmul_n
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=sizes.device) for _ in range(2))
    out = torch.empty_like(a)
    ms = median_ms(lambda: torch.mm(a, b, out=out), sizes.reps, sizes.device)
    return Row("bf16 matmul", 2 * n**3 / (ms / 1e3) / 1e12, "TFLOP/s", ms, notes=f"{n}^3")


def build_model(name: str, overrides: dict, sizes: Sizes, built: list[LoadedModel]) -> Row:
    """Random bfloat16 weights made on the device itself, through the engine's loader (into ``built``)."""
    fields = {"model_type": "llama"} | overrides  # a Llama unless named
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, max_position_embeddings=sizes.max_model_len)
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        synchronize(sizes.device)
        spec = ModelSpec(source=folder, dtype="bfloat16", device=sizes.device, dummy_weights=True)
        load_s = seconds(lambda: (built.append(load_model(spec)), synchronize(sizes.device)))
    num_params = sum(p.numel() for p in built[-1].model.parameters())
    return Row(f"{name} dummy weights on {sizes.device}", load_s, "s", notes=f"{num_params / 1e6:,.1f} M parameters")


def make_requests(core: EngineCore, tag: str, count: int, prompt_len: int, new_tokens: int) -> list:
    rng = random.Random(f"{tag}-{count}-{prompt_len}")
    prompts = [[rng.randrange(core.vocab_size) for _ in range(prompt_len)] for _ in range(count)]
    return [greedy_request(f"{tag}-{i}", prompt, new_tokens) for i, prompt in enumerate(prompts)]


def run_decode(core: EngineCore, requests: list) -> tuple[float, int, int]:
    """(seconds, steps, tokens) of the steps after each request's first token (the prefill step)."""
    prefilled(core, requests)
    synchronize(core.device)
    start, steps, tokens = time.perf_counter(), 0, 0
    while core.has_work():
        tokens += sum(len(out.token_ids) for out in core.step())
        steps += 1
    synchronize(core.device)
    return time.perf_counter() - start, steps, tokens


def hbm_floor_ms(weight_bytes: int, copy: Row) -> float | None:
    """The weights' bytes / the copy's bandwidth counted read + written (the lower floor; KV reads left out)."""
    return weight_bytes / (copy.value * 1e9) * 1e3 if copy.value else None


def use_mode(core: EngineCore, mode: str) -> None:
    """Decode steps from now on: ``fused`` (graphs on the fused kernels, steps overlapped: the GPU's default),
    ``fused-sync`` (one step at a time), ``fused-lt`` (preferring cuBLASLt), ``graphs`` (of the forward), ``eager``."""
    fused = mode.startswith("fused")
    kernels = core.runner.triton_decode_kernels() if fused else None
    if fused and kernels is None:
        raise RuntimeError("the fused decode kernels cannot run here (the engine's log says why)")
    core.config = core.config.model_copy(update={"async_scheduling": "off" if mode == "fused-sync" else "auto"})
    if core.device.type == "cuda":  # before the graphs are captured: they keep the kernels chosen then
        torch.backends.cuda.preferred_blas_library("cublaslt" if mode == "fused-lt" else DEFAULT_BLAS)
    core.runner.use_cuda_graphs(DEFAULT_CUDA_GRAPH_BATCH_SIZES if mode != "eager" else None, kernels=kernels)


def decode_row(
    label: str, core: EngineCore, batch: int, sizes: Sizes, weight_bytes: int, copy: Row, mode: str, prompt_len: int = 0
) -> Row:
    """Decode at ``batch`` in ``mode`` after prompts of ``prompt_len`` tokens (0: ``sizes.prompt_len``)."""
    if mode != "eager" and core.device.type != "cuda":
        return Row(label, notes="n/a: CUDA graphs need CUDA")
    use_mode(core, mode)
    prompt_len = prompt_len or sizes.prompt_len
    # the warm-up (context prompt + 4) shares the timed run's padded sizes: it captures every graph replayed
    run_decode(core, make_requests(core, "warm", batch, prompt_len, 4))
    decode_s, steps, tokens = run_decode(core, make_requests(core, "decode", batch, prompt_len, sizes.new_tokens))
    step_ms = decode_s / (tokens / batch) * 1e3  # per token of each sequence (a step in flight lands later)
    notes = f"{steps} steps, ctx {prompt_len}-{prompt_len + sizes.new_tokens}; "
    notes += f"floor: {weight_bytes / 1e6:,.1f} MB of weights / copy GB/s (read+written)"
    kv_bytes = batch * (prompt_len + sizes.new_tokens // 2) * core.layout.bytes_per_token
    with_kv = hbm_floor_ms(weight_bytes + kv_bytes, copy)
    if with_kv:
        notes += f"; with the K/V read ({kv_bytes / 1e6:,.1f} MB): {with_kv:.3f} ms, x{step_ms / with_kv:.2f}"
    if core.runner.graphs is not None:
        captured = ", ".join(f"{k.batch}x{k.num_blocks}" for k in core.runner.graphs.captured)
        notes += f"; graphs (batch x blocks): {captured}; {core.runner.graphs.num_replays} replays"
    return Row(label, tokens / decode_s, "tok/s", step_ms, hbm_floor_ms(weight_bytes, copy), notes)


def replay_row(label: str, core: EngineCore, batch: int, sizes: Sizes, weight_bytes: int, copy: Row) -> Row:
    """The last decode step's graph replayed again, timed on the device: the step without the host's work."""
    graphs = core.runner.graphs
    keys = [k for k in graphs.captured if k.batch >= batch and k.num_queries == 1] if graphs else []
    if not keys:
        return Row(label, notes="n/a: no graph was captured")
    key = min(keys, key=lambda k: (k.batch, -k.num_blocks))
    ms, floor_ms = median_ms(lambda: graphs.replay_again(key), 20, sizes.device), hbm_floor_ms(weight_bytes, copy)
    return Row(label, 1e3 / ms * batch, "tok/s", ms, floor_ms, f"graph {key.batch}x{key.num_blocks}")


def kernels_row(label: str, core: EngineCore, batch: int, sizes: Sizes, weight_bytes: int, copy: Row, mode: str):
    """Per decode step, the GPU kernels' count and busy time (gaps left out) by ``KERNEL_KINDS``, profiled."""
    if core.device.type != "cuda":
        return Row(label, notes="n/a: CUDA only")
    use_mode(core, mode)
    run_decode(core, make_requests(core, "kernels-warm", batch, sizes.prompt_len, 4))
    prefilled(core, make_requests(core, "kernels", batch, sizes.prompt_len, 9))
    synchronize(core.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps = 0
        while core.has_work():
            core.step()
            steps += 1
        synchronize(core.device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return Row(label, notes=f"no kernel recorded in {steps} steps ({mode})")
    by_kind: dict[str, list[float]] = {}
    for event in kernels:
        name = event.name.lower()
        kind = next((k for k, marks in KERNEL_KINDS if any(m in name for m in marks)), "other")
        by_kind.setdefault(kind, []).append(event.time_range.elapsed_us())
    busy_ms = sum(map(sum, by_kind.values())) / 1e3 / steps
    notes = "; ".join(
        f"{k}: {len(v) / steps:.0f} kernels, {sum(v) / 1e3 / steps:.3f} ms" for k, v in sorted(by_kind.items())
    )
    return Row(label, len(kernels) / steps, "kernels/step", busy_ms, hbm_floor_ms(weight_bytes, copy), notes)


def speculative_row(label: str, loaded: LoadedModel, config: EngineConfig, sizes: Sizes) -> Row:
    """Batch-1 n-gram speculation (k=4) on a prompt repeating a 16-token phrase: the median verify step against
    the median plain one (random weights accept what they happen to repeat; the notes say how much)."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=4)
    core = EngineCore(loaded, config.model_copy(update={"speculative": spec, "max_num_seqs": 1}))
    phrase = make_requests(core, "spec-phrase", 1, 16, 1)[0].prompt_token_ids
    prompt = (phrase * (sizes.prompt_len // 16 + 1))[: sizes.prompt_len]
    times: dict[bool, list[float]] = {True: [], False: []}
    for tag in ("warm", "timed"):
        prefilled(core, [greedy_request(f"spec-{tag}", prompt, sizes.new_tokens)])
        while core.has_work():
            drafts = core.spec_counters.num_drafts
            start = time.perf_counter()
            core.step()
            times[core.spec_counters.num_drafts > drafts].append(time.perf_counter() - start)
    counters = core.spec_counters
    verify_ms = statistics.median(times[True]) * 1e3 if times[True] else None
    plain = f"{statistics.median(times[False]) * 1e3:.3f}" if times[False] else "none"
    notes = f"{len(times[True])} verify steps, {len(times[False])} plain ({plain} ms median); "
    notes += f"{counters.num_accepted_tokens} of {counters.num_draft_tokens} proposed tokens accepted"
    return Row(label, verify_ms and 1e3 / verify_ms, "verify steps/s", verify_ms, notes=notes)


def prefill_row(name: str, core: EngineCore, sizes: Sizes, layer_params: int, matmul: Row) -> Row:
    """One prompt's prefill; the floor: 2 x decoder-layer parameters x tokens / the matmul rate."""

    def once(tag: str) -> float:
        core.add_request(make_requests(core, tag, 1, sizes.prefill_len, 1)[0])
        synchronize(core.device)
        return seconds(lambda: (drain(core), synchronize(core.device)))

    once("prefill-warm")
    prefill_s = statistics.median(once(f"prefill-{i}") for i in range(sizes.prefill_reps))
    tokens = sizes.prefill_len
    flops = 2 * layer_params * tokens  # the LM head and the attention scores left out
    floor_ms = flops / (matmul.value * 1e12) * 1e3 if matmul.value else None
    notes = f"median of {sizes.prefill_reps}; floor: 2 x layer params x tokens ({flops / 1e9:,.1f} GFLOP) / matmul"
    return Row(f"{name} prefill {tokens} tokens", tokens / prefill_s, "tok/s", prefill_s * 1e3, floor_ms, notes)


def model_rows(name: str, overrides: dict, sizes: Sizes, copy: Row, matmul: Row, speculate: bool) -> Iterator[Row]:
    """Each guarded: the build; decode at each batch in each of ``MODES`` (from graphs, then the replay alone and the
    step's kernels; eager at batch 1, its kernels too); batch 1 at a long context; prefill; speculation."""
    built: list[LoadedModel] = []
    yield guarded(f"{name} dummy weights", build_model, name, overrides, sizes, built)
    if not built:
        return
    loaded = built.pop()
    # counted before the runner fuses some weights into buffers
    weight_bytes = decode_weight_bytes(loaded.model)
    layer_params = sum(p.numel() for p in getattr(loaded.model, loaded.model.base_model_prefix).layers.parameters())
    # every batch's prompts in one step, so all its requests decode from the same step on
    max_tokens = max(sizes.max_model_len, max(sizes.decode_batches) * sizes.prompt_len)
    config = EngineConfig(max_model_len=sizes.max_model_len, kv_cache_bytes=sizes.kv_cache_bytes,
                          max_num_seqs=max(sizes.decode_batches), max_num_batched_tokens=max_tokens)  # fmt: skip
    try:
        core = EngineCore(loaded, config)
    except Exception as exc:  # e.g. no memory left for the pool: the next model still runs
        yield error_row(f"{name} engine", exc)
        return
    for batch in sizes.decode_batches:
        for mode, variant in MODES.items():
            label = f"{name} decode batch {batch}, {variant}"
            args = (core, batch, sizes, weight_bytes, copy)
            yield guarded(label, decode_row, label, *args, mode)
            core.abort_all()  # a failed row must not leave requests behind for the next
            if mode in REPLAY_SUFFIX and core.device.type == "cuda":
                replay_label = f"{name} graph replay alone, batch {batch}{REPLAY_SUFFIX[mode]}"
                yield guarded(replay_label, replay_row, replay_label, *args)
            if mode in REPLAY_SUFFIX or (mode == "eager" and batch == 1):
                kernels_label = f"{name} kernels of a decode step, batch {batch}, {variant}"
                yield guarded(kernels_label, kernels_row, kernels_label, *args, mode)
                core.abort_all()
    for mode in ("fused", "graphs"):  # one long context: the fused attention splits it into parts
        label = f"{name} decode batch 1, {MODES[mode]}, context {sizes.long_prompt_len}"
        args = (core, 1, sizes, weight_bytes, copy, mode, sizes.long_prompt_len)
        yield guarded(label, decode_row, label, *args)
        core.abort_all()
    core.runner.use_cuda_graphs(None)  # prefill runs eagerly in every mode
    yield guarded(f"{name} prefill", prefill_row, name, core, sizes, layer_params, matmul)
    core.abort_all()
    if speculate:
        label = f"{name} speculative decode, batch 1"
        yield guarded(label, speculative_row, label, loaded, config, sizes)
    core = loaded = None  # its memory back (the model with it) before the next model is made
    gc.collect()
    torch.cuda.empty_cache()  # a no-op where CUDA was never used


def run(sizes: Sizes) -> Iterator[Row]:
    yield (copy := guarded("copy bandwidth", copy_bandwidth, sizes))
    yield (matmul := guarded("bf16 matmul", matmul_flops, sizes))
    for i, (name, overrides) in enumerate(sizes.models):
        yield from model_rows(name, overrides, sizes, copy, matmul, speculate=i == 0)


def main(argv: list[str] | None = None) -> None:
    parser = arguments("bench.gpu_engine", __doc__.splitlines()[0], help="also write the rows as JSON here")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU: a dry run of the code path")
    args = parser.parse_args(argv)
    sizes = TINY_SIZES if args.tiny else GPU_SIZES
    if sizes.device == "cuda" and not torch.cuda.is_available():
        skipped = Row("all rows", notes="skipped: no CUDA (use --tiny for the CPU dry run)")
        return print(HEADER, skipped.markdown(), sep="\n")
    start, rows = time.perf_counter(), []
    name = torch.cuda.get_device_name() if sizes.device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    device = f"{name}, torch {torch.__version__}"
    print(f"{device}\n\n{HEADER}", flush=True)
    for row in run(sizes):
        rows.append(row)
        print(row.markdown(), flush=True)
    total_s = time.perf_counter() - start
    print(f"\ntotal {total_s:.1f} s")
    if args.out:
        report = {"device": device, "tiny": args.tiny, "total_s": total_s, "rows": list(map(asdict, rows))}
        write_json(args.out, report, indent=2)


if __name__ == "__main__":
    main()
