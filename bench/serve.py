"""Load generator for any OpenAI-compatible server: ``python -m bench.serve`` (or ``tandem-bench``).

Streams ``/v1/completions`` (prompts as token ids of exact lengths, or ``--prompt-format text``; ``ignore_eos``) at
Poisson, gamma (``--cv``) or traced arrivals; per rate TTFT / TPOT / ITL / E2E, throughput and SLO attainment, and the
goodput (``bench.slo``), as JSON and plots. SLOs are fixed (``--slo-ttft-ms``, ``--slo-tpot-ms``) or multiples of the
idle server's latency (``--slo-scale``).

  python -m bench.serve --url http://127.0.0.1:8000 --workload summarization --rates 0.2,0.4,0.6"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass

import httpx

from bench.host import tokenizer as load_tokenizer
from bench.report import arguments, plot_attainment, plot_cdfs, write_json
from bench.slo import SLO, RequestRecord, goodput, summarize
from workloads import WORKLOADS, BenchRequest, arrival_times, load_trace, make_requests, median_request

POLL_S = 1.0  # GET /admin/autoscaler period of ``poll_autoscaler``
# server-side TTFT parts (Prometheus histograms exported by the tandem replicas)
SPLIT_METRICS = {"ingress_ttft": "ray_tandem_ttft_seconds", "kv_transfer": "ray_tandem_kv_transfer_seconds"} | {
    p: f"ray_tandem_ttft_{p}_seconds" for p in ("prefill_hop", "prefill_queue", "prefill_compute", "decode_queue")
}
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")  # name, labels, value
STREAM = {"temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # greedy


@dataclass
class Target:
    url: str
    model: str
    prompt_format: str = "ids"  # or "text"
    tokenizer: object = None  # needed for "text"

    def body(self, request: BenchRequest) -> dict:
        prompt = request.prompt
        if self.prompt_format == "text" and not isinstance(prompt, str):
            prompt = self.tokenizer.decode(prompt)
        return {"model": self.model, "prompt": prompt, "max_tokens": request.max_tokens, **STREAM}


def client(timeout: float | httpx.Timeout = 600.0, **options) -> httpx.AsyncClient:
    """The benchmarks' HTTP client: no connection limit, 10 minutes a request; ``options``: httpx's."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=timeout, limits=limits, **options)


async def send(client: httpx.AsyncClient, target: Target, request: BenchRequest) -> RequestRecord:
    record = RequestRecord(request.prompt_tokens, request.max_tokens, time.perf_counter())
    await stream(client, target.url + "/v1/completions", target.body(request), record)
    return record


async def stream(client: httpx.AsyncClient, url: str, body: dict, record: RequestRecord, texts: list | None = None):
    """POST ``body`` (a completion or chat); its stream into ``record`` (times as read), ``texts``; the last usage."""
    usage: dict = {}
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return usage
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now, chunk = time.perf_counter(), json.loads(line[6:])
                if "error" in chunk:
                    record.error = str(chunk["error"].get("message"))
                    break
                record.last, usage = now, chunk.get("usage") or usage
                choices = chunk.get("choices", ())
                if text := "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices):
                    record.chunks.append(now)
                    if texts is not None:
                        texts.append(text)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    if usage:
        record.usage_prompt_tokens, record.usage_output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
    if record.error is None and not record.chunks:
        record.error = "no tokens received"
    return usage


async def run(target: Target, requests: list[BenchRequest], offsets: list[float], label: str = "",
              progress: bool = True) -> tuple[list[RequestRecord], float]:  # fmt: skip
    """Send each request at its offset; wait for all. Returns the records and the duration."""
    from tqdm.auto import tqdm

    with tqdm(total=len(requests), desc=label, unit="req", disable=not progress, file=sys.stderr, leave=False) as bar:
        async with client() as http:

            async def one(request: BenchRequest, offset: float) -> RequestRecord:
                delay = start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                record = await send(http, target, request)
                bar.update(1)
                return record

            start = time.perf_counter()
            records = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
            duration = time.perf_counter() - start
    return list(records), duration


def run_checked(target: Target, requests: list[BenchRequest], what: str) -> list[RequestRecord]:
    records, _ = asyncio.run(run(target, requests, [0.0] * len(requests), progress=False))
    if bad := [r.error for r in records if not r.ok]:
        raise RuntimeError(f"{what} failed: {bad[0]}")
    return records


def uncontended(target: Target, request: BenchRequest, repeats: int = 3, max_tokens: int = 32) -> dict[str, float]:
    """TTFT and TPOT of ``request`` on the idle server, one at a time (medians of ``repeats`` after a warm-up)."""
    probe = BenchRequest(request.prompt, request.prompt_tokens, max_tokens)
    records = [run_checked(target, [probe], "uncontended probe")[0] for _ in range(repeats + 1)][1:]
    ttft, tpot = statistics.median(r.ttft for r in records), statistics.median(r.tpot for r in records)
    return {"prompt_tokens": request.prompt_tokens, "ttft_s": ttft, "tpot_s": tpot}


def scrape(metrics_url: str | None) -> dict[str, tuple[float, float]]:
    """(sum, count) of each split histogram, summed over replicas; {} without a URL."""
    if not metrics_url:
        return {}
    totals: dict[str, list[float]] = {}
    for match in map(SAMPLE.match, httpx.get(metrics_url, timeout=10).text.splitlines()):
        for key, metric in SPLIT_METRICS.items():
            if match and match.group(1) in (metric + "_sum", metric + "_count"):
                totals.setdefault(key, [0.0, 0.0])[match.group(1).endswith("_count")] += float(match.group(3))
    return {k: (v[0], v[1]) for k, v in totals.items()}


def split_means(before: dict, after: dict) -> dict[str, float]:
    """Each histogram's mean over what it counted between two ``scrape`` readings."""
    deltas = {key: [a - b for a, b in zip(sums, before.get(key, (0.0, 0.0)))] for key, sums in after.items()}
    return {key: total / count for key, (total, count) in deltas.items() if count > 0}


def sweep(target: Target, requests: list[BenchRequest], rates: list[float], slo: SLO, process: str = "poisson",
          cv: float = 1.0, seed: int = 0, metrics_url: str | None = None, label: str = "") -> dict:  # fmt: skip
    """Run the same requests at each rate; attainment per rate and the goodput."""
    points = []
    for rate in rates:
        offsets = arrival_times(len(requests), rate, process, cv, seed)
        before = scrape(metrics_url)
        records, duration = asyncio.run(run(target, requests, offsets, f"{label} {rate:.3g} req/s"))
        if metrics_url:
            time.sleep(3.0)  # let the replicas' metrics reach the exporter
        split = split_means(before, scrape(metrics_url))
        summary = summarize(records, duration, slo) | {"rate": rate, "server_ttft_split_s": split}
        points.append(summary | {"records": [r.to_json() for r in records]})
        ttft, tpot = summary["ttft_s"]["p90"], summary["tpot_s"]["p90"]
        print(f"  {label} rate {rate:.3g}/s: attainment {summary['attainment']:.0%}, TTFT p90 {ttft:.2f} s, "
              f"TPOT p90 {tpot * 1e3:.0f} ms, failed {summary['failed']}", file=sys.stderr)  # fmt: skip
    found = goodput([(p["rate"], p["attainment"]) for p in points])
    return {"points": points, "goodput": {"rate": found.rate, "bound": found.bound, "text": str(found)}}


def warm_up(target: Target, requests: list[BenchRequest]) -> None:
    """Two short requests (4 tokens) like each of ``requests``, at once, through every path (not counted)."""
    for request in requests:
        probe = BenchRequest(request.prompt, request.prompt_tokens, 4)
        run_checked(target, [probe, probe], "warm-up request")


async def poll_autoscaler(url: str, started: tuple[float, float], stop: asyncio.Event, extra=None) -> tuple[list, list]:
    """Samples of the autoscaler's view (and ``await extra()``'s fields) every ``POLL_S`` until ``stop``,
    and every decision seen, once, by time since ``started`` (its ``perf_counter`` and ``time`` clocks)."""
    (t0, wall0), timeline, decisions = started, [], {}
    async with httpx.AsyncClient(timeout=5.0) as client:
        while not stop.is_set():
            tick = time.perf_counter()
            sample = {"t": round(tick - t0, 2), **(await extra() if extra else {})}
            try:
                view = (await client.get(url + "/admin/autoscaler")).json()
                replicas = [{"deployment": r["deployment"], "replica": r["replica_id"], "role": r["role"], **r["load"]}
                            for r in view.get("replicas", [])]  # fmt: skip
                sample |= {"replicas": replicas, "in_flight": view.get("ingress", {}).get("in_flight", {})}
                sample |= {"observed": view.get("observed", {}), "scaling": view.get("scaling", {})}
                for d in view.get("decisions", []):
                    key = (d["monotonic_s"], d["action"], d["replica"], d["role"])
                    decisions[key] = {"t": round(d["time"] - wall0, 2), **d}
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                print(f"autoscaler poll failed: {exc!r}", file=sys.stderr)
            timeline.append(sample)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, POLL_S - (time.perf_counter() - tick)))
    return timeline, sorted(decisions.values(), key=lambda d: d["t"])


def polled(url: str, load, poll: bool = True, extra=None, linger_s: float = 0.0) -> tuple:
    """``asyncio.run`` of ``load(t0)`` (``t0``: its start, ``perf_counter``) with, when ``poll``, the autoscaler polled
    until ``linger_s`` after it: (its result, ``poll_autoscaler``'s samples and decisions, the start on both clocks)."""

    async def both() -> tuple:
        stop, started = asyncio.Event(), (time.perf_counter(), time.time())
        poller = poll and asyncio.create_task(poll_autoscaler(url, started, stop, extra))
        result = await load(started[0])
        await asyncio.sleep(linger_s)
        stop.set()
        return result, *(await poller if poller else ([], [])), started

    return asyncio.run(both())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = arguments("bench.serve", __doc__, "bench-results", "folder for results.json and the plots")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    parser.add_argument("--tokenizer", default="default", help="tokenizer source: 'default', HF dir or .gguf")
    parser.add_argument("--max-model-len", type=int, help="server context (default: from GET /v1/models)")
    parser.add_argument("--workload", choices=WORKLOADS, default="summarization")
    parser.add_argument("--trace", help="JSONL trace to replay (arrival_s, prompt or prompt_tokens, max_tokens)")
    parser.add_argument("--num-requests", type=int, default=40, help="requests per rate point")
    parser.add_argument("--rates", default="0.5", help="comma-separated arrival rates (req/s)")
    parser.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    parser.add_argument("--cv", type=float, default=2.0, help="gamma arrivals: coefficient of variation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-format", choices=("ids", "text"), default="ids")
    parser.add_argument("--slo-ttft-ms", type=float)
    parser.add_argument("--slo-tpot-ms", type=float)
    parser.add_argument("--slo-scale", default="5,2", help="TTFT,TPOT multiples of the uncontended latency")
    parser.add_argument("--metrics-url", help="Prometheus endpoint for the server-side TTFT split")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = httpx.get(args.url + "/v1/models", timeout=30).json()["data"][0]
    max_model_len = args.max_model_len or info.get("max_model_len")
    if max_model_len is None:
        sys.exit("--max-model-len is needed: the server does not report its context")
    tokenizer = load_tokenizer(args.tokenizer)
    target = Target(args.url, args.model or info["id"], args.prompt_format, tokenizer)
    args.out.mkdir(parents=True, exist_ok=True)
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3) if args.slo_ttft_ms and args.slo_tpot_ms else None
    if args.trace:
        requests = load_trace(args.trace, tokenizer)
        offsets = [r.arrival_s - requests[0].arrival_s for r in requests]
        records, duration = asyncio.run(run(target, requests, offsets, "trace"))
        result = {"trace": args.trace, **summarize(records, duration, slo)}
    else:  # without fixed SLOs, multiples of the idle server's latency first
        requests = make_requests(args.workload, tokenizer, max_model_len, args.num_requests, args.seed)
        base = None if slo else uncontended(target, median_request(requests))
        if slo is None:
            ttft_x, tpot_x = (float(x) for x in args.slo_scale.split(","))
            slo = SLO(ttft_x * base["ttft_s"], tpot_x * base["tpot_s"])
        print(f"SLO: TTFT <= {slo.ttft_s:.3f} s, TPOT <= {slo.tpot_s * 1e3:.0f} ms", file=sys.stderr)
        rates = [float(r) for r in args.rates.split(",")]
        points = sweep(target, requests, rates, slo, args.arrival, args.cv, args.seed, args.metrics_url, args.workload)
        result = {"workload": args.workload, "model": target.model, "uncontended": base, **points}
        plot_attainment({args.workload: {"this server": result}}, args.out / "attainment.png")
        plot_cdfs({"this server": result["points"][-1]}, args.out / "cdf.png", args.workload)
    write_json(args.out / "results.json", result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("points", "records")}, indent=1))
    print(f"wrote {args.out / 'results.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
