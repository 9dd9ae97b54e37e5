"""Serve overhead benchmark: ``python -m bench.serve_overhead`` (docs/benchmarks/serve_overhead.md, its block).

What the Serve path adds per token (ITL through the ingress against the engine's own step) and to
the first token (TTFT through disagg_app minus colocated_app minus the KV transfer), one request at
a time; every figure is paired within one repetition, since the machine's speed drifts."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import httpx

from app.local_cluster import Server
from bench.host import engine_core, seconds
from bench.report import arguments, command_line, publish, table

NAME = "bench.serve_overhead"
PORT = 18433
MODEL = "SmolLM2-135M-Instruct"
NUM_TOKENS = 48
REPEATS = 20
PROMPT = [{"role": "user", "content": "Write a short paragraph about the history of bridges."}]
ROWS = (  # figure, its key in serve_overhead.json, target
    ("engine decode step, in process", "engine_step_ms", ""),
    ("engine step inside the decode replica (its last 64 model steps)", "decode_replica_step_ms", ""),
    ("inter-token latency through the ingress, p50 of all tokens", "itl_p50_ms", ""),
    ("overhead per token (request's ITL p50 - engine step in process)", "itl_overhead_ms", "<= 2"),
    ("the Serve path alone (request's ITL p50 - replica step)", "serve_path_ms", ""),
    ("TTFT, disagg_app", "ttft_disagg_ms", ""),
    ("TTFT, colocated_app", "ttft_colocated_ms", ""),
    ("KV transfer measured on the decode replica", "kv_transfer_ms", ""),
    ("TTFT added by the prefill -> decode hop, without the transfer", "hop_added_ms", "<= 15"),
)


def step_ms(core) -> float:
    """Median decode step (ms) of one request like the streamed one on ``core`` (in this process)."""
    from engine.params import SamplingParams

    core.add_request(core.make_request(PROMPT, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)))
    core.step()
    steps = []
    while core.has_work():
        steps.append(seconds(core.step))
    return statistics.median(steps) * 1e3


def stream_once(url: str) -> tuple[float, list[float]]:
    """TTFT and the gaps between content chunks, seen by the client (seconds)."""
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True}
    start, arrivals = time.perf_counter(), []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body | {"stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                arrivals.append(time.perf_counter())
    return arrivals[0] - start, [b - a for a, b in zip(arrivals, arrivals[1:])]


def main(argv: list[str] | None = None) -> None:
    arguments(NAME, __doc__).parse_args(argv)
    from ray import serve

    from app.config import colocated_app

    local = engine_core(max_model_len=1024, kv_cache_bytes=64 << 20)  # as a replica: one torch thread
    step_ms(local)  # warm-up
    common = {"model.max_model_len": "1024", "engine.kv_cache_bytes": str(64 << 20),
              "colocated.num_replicas": "1", "autoscaling.enabled": "false"}  # fmt: skip
    with Server("disagg", common, port=PORT) as server:
        serve.run(colocated_app(common), name="colo", route_prefix="/colo")
        decode = serve.get_deployment_handle("DecodeServer", app_name=server.name)
        repetitions = [repetition(server.url, decode, local) for _ in range(REPEATS + 1)][1:]
    rows = [row for row, _ in repetitions]
    result = {"command": command_line(NAME)} | {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    result["itl_p50_ms"] = statistics.median(gap for _, gaps in repetitions for gap in gaps) * 1e3
    data = result | {"repetitions": rows}
    publish(Path("docs/benchmarks"), "serve_overhead", NAME, data, render(result), "# Serve overhead benchmark")


def repetition(base: str, decode, local) -> tuple[dict[str, float], list[float]]:
    """One request through disagg_app, colocated_app and the engine here: the figures (ms), its gaps (s)."""
    t_d, gaps = stream_once(base)
    # the replica's last 64 model steps: this request's 47 and the end of the one before
    replica_step_ms = decode.stats.remote().result().median_step_ms
    transfer_s = decode.last_transfer.remote().result()["seconds"]
    t_c, _ = stream_once(base + "/colo")
    engine_ms = step_ms(local)
    itl_ms = statistics.median(gaps) * 1e3
    row = {"engine_step_ms": engine_ms, "decode_replica_step_ms": replica_step_ms, "itl_ms": itl_ms,
           "itl_overhead_ms": itl_ms - engine_ms, "serve_path_ms": itl_ms - replica_step_ms,
           "ttft_disagg_ms": t_d * 1e3, "ttft_colocated_ms": t_c * 1e3, "kv_transfer_ms": transfer_s * 1e3,
           "hop_added_ms": (t_d - t_c - transfer_s) * 1e3}  # fmt: skip
    return row, gaps


def render(r: dict) -> list[str]:
    """The generated block of serve_overhead.md, from serve_overhead.json (the page describes the method)."""
    rows = [[label, f"{r[key]:.1f}", target] for label, key, target in ROWS]
    return [f"Command: `{r['command']}`.", "", *table("figure | ms | target", rows)]


if __name__ == "__main__":
    main()
