"""A replica's memory against PyTorch's per-shape CPU kernel caches: ``python -m bench.kernel_caches``.

One engine prefills prompts of random lengths one at a time (its resident memory every 50 prompts), then a decode-heavy
mix, per cache setting in a fresh subprocess (both caches read their capacity at the first oneDNN call). ``default``:
PyTorch's own capacities; a number: ``CACHES`` set to it (figures in docs/reliability.md)."""

from __future__ import annotations

import os
import random
import time

from bench.engine import drain, greedy_request
from bench.host import engine_core, worker_json
from bench.report import arguments

CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def _request(name: str, rng: random.Random, length: int, max_tokens: int):
    return greedy_request(name, [rng.randint(10, 40000) for _ in range(length)], max_tokens)


def worker(prompts: int, batches: int) -> dict:
    """The measurement, in this process: RSS every 50 prompts, then decode tokens/s."""
    import psutil

    core = engine_core(max_model_len=1024, kv_cache_bytes=64 << 20, enable_prefix_caching=False)
    rng, rss, started, tokens = random.Random(0), [], time.perf_counter(), 0
    for i in range(prompts):
        length = rng.randint(16, 900)
        tokens += length
        core.add_request(_request(f"p{i}", rng, length, 1))
        drain(core)
        if i % 50 == 0 or i == prompts - 1:
            rss.append({"prompts": i + 1, "rss_mib": round(psutil.Process().memory_info().rss / 2**20)})
    prefill_rate = tokens / (time.perf_counter() - started)
    started, tokens = time.perf_counter(), 0
    for b in range(batches):
        size = rng.randint(1, 16)
        for j in range(size):
            core.add_request(_request(f"d{b}-{j}", rng, rng.randint(16, 200), 12))
        drain(core)
        tokens += 12 * size
    return {"caches": {name: os.environ.get(name) for name in CACHES}, "rss": rss,
            "prefill_tokens_per_s": round(prefill_rate, 1),
            "mixed_tokens_per_s": round(tokens / (time.perf_counter() - started), 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = arguments("bench.kernel_caches", __doc__)
    parser.add_argument("--caches", default="default,8,64", help="settings to compare, comma-separated")
    parser.add_argument("--prompts", type=int, default=250)
    parser.add_argument("--batches", type=int, default=40)
    args = parser.parse_args(argv)
    for setting in args.caches.split(","):
        # "default": PyTorch's own capacities (setting the variables to 1024 keeps the engine's bound off)
        env = os.environ | dict.fromkeys(CACHES, "1024" if setting == "default" else setting)
        result = worker_json("bench.kernel_caches", "worker", args.prompts, args.batches, env=env)
        series = ", ".join(f"{p['prompts']}: {p['rss_mib']}" for p in result["rss"])
        rates = f"prefill {result['prefill_tokens_per_s']} tok/s, mixed decode {result['mixed_tokens_per_s']} tok/s"
        print(f"{setting}: RSS MiB after prompts {series}; {rates}", flush=True)


if __name__ == "__main__":
    main()
