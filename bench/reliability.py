"""Load and soak with faults, through the HTTP API: ``python -m bench.reliability``.

``disagg_app`` (1 prefill + 1 decode replica) with ``fault_specs``'s faults: a **burst** of concurrent streams,
then a **soak** of Poisson traffic meeting transfer faults, stalls and replica kills; after each, ``GET /admin/kv``
must show no block held. Writes ``<out>/benchmarks/reliability.json`` and ``<out>/reliability.md``'s block."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import ray

from app.local_cluster import Server, serve_logs
from app.settings import AppConfig
from bench.host import machine, tokenizer
from bench.report import arguments, cells, command_line, read_json, secs, table, template, write_json, write_page
from bench.serve import Target
from bench.serve import client as http_client
from engine.params import unique_request_id
from kv_transport.faults import FaultPoints
from workloads import BenchRequest, PromptBuilder

NAME, HTTP_PORT, MAX_MODEL_LEN = "bench.reliability", 18660, 512
TIMEOUT_S, PEER_CHECK_S = 20.0, 5.0  # transport.kv_transfer_timeout_s, transport.peer_check_interval_s
STREAM_IDLE_S = 60.0  # limits.stream_idle_timeout_s (the default)
HANG_S, LONG_S = STREAM_IDLE_S + 15.0, TIMEOUT_S + 15.0  # no byte for this long: a hang, a long silence
POOLS = ("PrefillServer", "DecodeServer")
# ``Outcome.result``: 200 with every token and [DONE]; closed by the client on purpose; 200 then an error event;
# [DONE] with fewer tokens than asked, or no [DONE] (silent cuts); no byte for HANG_S; connection refused, reset, ...
COMPLETED, DISCONNECTED, ERROR_EVENT, SHORT, CUT, HANG, CLIENT_ERROR = (
    "completed", "disconnected", "error_event", "short", "cut", "hang", "client_error"
)  # fmt: skip
HTTP_503, HTTP_504, HTTP_4XX, HTTP_5XX = "http_503", "http_504", "http_4xx", "http_5xx"
ANOMALIES = (HTTP_5XX, SHORT, CUT, HANG, CLIENT_ERROR)
RESULT_ORDER = (COMPLETED, DISCONNECTED, ERROR_EVENT, HTTP_503, HTTP_504, HTTP_4XX, *ANOMALIES)
MEMORY_GROWTH_LIMIT, MIN_MEMORY_WINDOW_S = 0.10, 60.0  # a replica's growth is judged over at least this long
QUICK = {"concurrency": 20, "soak_s": 90.0, "kill_every_s": 30.0, "stall_every_s": 40.0, "warmup_s": 20.0}
EXPECTED_LOG = {  # one line each, by design; a line counts under its first match, the ingress's first
    "ingress: retried before the first token": "retrying",
    "ingress: ended with an error after tokens": "ended with an error",
    "ingress: aborted for no output (504)": "no output for",
    "ingress: no replica within recovery.wait_s (503)": "no replica could take",
    "replica: crash injected": "fault injection: crashing",
    "replica: exported KV unclaimed, freed at the lease's end": "unclaimed after",
    "replica call failed (Serve's line): injected transfer fault": "injected failure at",
    "replica call failed (Serve's line): fetch refused, its lease over": "lease expired",
    "replica call failed (Serve's line): READ from a killed peer": "NIXL_ERR_REMOTE_DISCONNECT",
    "proxy: client disconnected": "disconnected, cancelling request",
}
SERVE_COMPONENTS = ("controller", "proxy")  # Ray Serve's own processes, not this project's code
LOG_KINDS = {  # the JSON's key of each kind of line not expected, and its title on the page
    "unexpected": "unexpected in the ingress and engine replicas (tracebacks, errors not injected)",
    "other_warnings": "other warnings of the ingress and engine replicas",
    "serve_internal": "warnings, errors and tracebacks of Ray Serve's own controller and proxy",
}
SERVE_LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d{4}-\d\d-\d\d [\d:,]+ (\S+) ")
RULE_KEYS = {k: i for i, k in enumerate(("point", "action", "probability", "seconds", "request_id_prefix"))}
PHASE_LINE = ("**{name}**: {requests} requests in {duration_s:.0f} s; completed: median E2E "
              "{median_e2e_s}, p90 {p90_e2e_s}, median TTFT {median_ttft_s}; hangs (no byte for > "
              "{hang_bound_s:g} s): {hangs}; long silences (> {long_silence_s:g} s): {long_silences}; "
              "longest silence {max_silence_s}.")  # fmt: skip
TARGET_ROW, YES = "{check} | {target} | {measured} | {met}", {True: "yes", False: "**NO**"}
DISCONNECT = {"name": "client disconnect", "kind": "disconnect", "rules": [], "effect": "by design"}
KILLS = ("# | replica | request | its client saw | others in flight or sent before the restart | restart | first OK "
         "after crash | recovered")  # fmt: skip
MEMORY = "deployment | engine | first seen |  | RSS after warm-up (MiB) | RSS last (MiB) | growth"


@dataclass
class Outcome:
    """One request as the client saw it."""

    request_id: str
    phase: str  # burst | soak | warmup
    kind: str  # plain | disconnect | stall | kill-prefill | kill-decode | probe
    faults: tuple[str, ...]  # the probabilistic fault rules drawn for this request id
    prompt_tokens: int
    max_tokens: int
    sent_s: float
    end_s: float | None = None
    status: int | None = None
    result: str = CLIENT_ERROR
    cause: str | None = None  # the error's code (or message), the exception's type
    num_tokens: int = 0  # text chunks received
    first_token_s: float | None = None
    last_token_s: float | None = None
    max_silence_s: float = 0.0  # longest time without a byte, from the send on


@dataclass
class KillEvent:
    """One replica killed by a prefixed request (``kind``: prefill or decode)."""

    kind: str
    request_id: str
    old_engine: str | None = None
    new_engine: str | None = None
    crash_s: float | None = None  # decode: the kill request's last token; prefill: the dead replica's last report
    restarted_s: float | None = None  # the new engine id first seen live in /admin/kv


@dataclass
class EngineMemory:
    """One engine replica's resident memory: after its warm-up, and last seen."""

    engine_id: str
    deployment: str
    first_seen_s: float
    last_seen_s: float
    warm_s: float | None = None
    warm_rss: int | None = None
    last_rss: int | None = None
    live_at_end: bool = False

    @property
    def growth(self) -> float | None:
        if self.warm_rss is None or self.last_rss is None or self.last_seen_s - self.warm_s < MIN_MEMORY_WINDOW_S:
            return None
        return round(self.last_rss / self.warm_rss - 1, 4)


def fault_specs(mode: str) -> list[dict[str, Any]]:
    """Named faults: ``kind`` random (5% of requests each, drawn per request id) or the request kind whose
    id prefix selects them, their ``rules`` (``faults:`` entries), their ``effect`` in words."""
    transfer, slow = ("fetch", "fetch") if mode == "pull" else ("push_layer", "finish_push")
    stall = _rule(slow, "delay", seconds=TIMEOUT_S + 1, request_id_prefix="stall-")
    if mode == "pull":  # crash 50 ms after the export; the fetch held 1 s: the crash lands mid-transfer
        kill = [_rule("after_export", "crash", request_id_prefix="kill-prefill-", max_times=None),
                _rule("fetch", "delay", seconds=1.0, request_id_prefix="kill-prefill-")]  # fmt: skip
    else:
        kill = [_rule("push_layer", "crash", layer=15, request_id_prefix="kill-prefill-", max_times=None)]
    decode = _rule("mid_decode", "crash", request_id_prefix="kill-decode-", after_tokens=4, max_times=None)
    specs = [
        ("transfer failure", "random", [_rule(transfer, "fail", probability=0.05)], "the transfer raises"),
        ("slow transfer", "random", [_rule(slow, "delay", seconds=3.0, probability=0.05)], "the transfer waits 3 s"),
        ("dropped release notice", "random", [_rule("release", "drop", probability=0.05)],
         "the producer frees at the lease's end"),
        ("stalled transfer (past the lease)", "stall", [stall], "the transfer outlives its lease"),
        ("prefill replica killed mid-transfer", "kill-prefill", kill, "SIGKILL"),
        ("decode replica killed mid-stream", "kill-decode", [decode], "SIGKILL after 4 tokens"),
    ]  # fmt: skip
    keys = ("name", "kind", "rules", "effect")
    return [dict(zip(keys, spec)) for spec in specs if mode == "pull" or spec[0] != "dropped release notice"]


def _rule(point: str, action: str, **fields: Any) -> dict[str, Any]:
    return {"point": point, "action": action, **fields}


def app_args(mode: str, specs: list[dict]) -> dict[str, str]:
    return {
        "model.max_model_len": str(MAX_MODEL_LEN), "prefill.num_cpus": "0.25", "decode.num_cpus": "0.25",
        "autoscaling.enabled": "false", "transport.mode": mode, "transport.kv_transfer_timeout_s": str(TIMEOUT_S),
        "transport.peer_check_interval_s": str(PEER_CHECK_S), "limits.stream_idle_timeout_s": str(STREAM_IDLE_S),
        "faults": json.dumps([rule for spec in specs for rule in spec["rules"]]),
    }  # fmt: skip


@dataclass(frozen=True)
class Planned:
    """A request; a disconnect cuts it after ``cut_after_chunks`` text chunks (0: the headers) or ``cut_after_s``."""

    request_id: str
    phase: str
    kind: str
    prompt: list[int]
    max_tokens: int
    cut_after_chunks: int | None = None
    cut_after_s: float | None = None


class Client:
    """Streams requests and records what it saw; the run's clock starts at construction."""

    def __init__(self, url: str, model: str, specs: list[dict]) -> None:
        timeout = httpx.Timeout(connect=10.0, read=HANG_S, write=30.0, pool=None)
        self.http, self.target = http_client(timeout, base_url=url), Target(url, model)
        rules = [rule for spec in specs for rule in spec["rules"]]
        self._points = FaultPoints(AppConfig.model_validate({"faults": rules}).faults)
        self._names = [s["name"] if s["kind"] == "random" else None for s in specs for _ in s["rules"]]
        self.t0, self.wall0, self.outcomes = time.monotonic(), time.time(), list[Outcome]()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def drawn(self, request_id: str) -> tuple[str, ...]:
        """The probabilistic faults this request id meets (the server draws the same way)."""
        served_as = unique_request_id(request_id)  # the id the engines see: the server's draw
        met = {i for rule in self._points.rules for i, _ in self._points.selected(rule.point, served_as, rule.layer)}
        return tuple(name for i, name in enumerate(self._names) if name is not None and i in met)

    async def send(self, p: Planned) -> Outcome:
        out = Outcome(p.request_id, p.phase, p.kind, self.drawn(p.request_id), len(p.prompt), p.max_tokens, self.now())
        arrivals, usage = [out.sent_s], []  # the send, then when the headers and each line came
        body = self.target.body(BenchRequest(p.prompt, len(p.prompt), p.max_tokens))
        stream = self.http.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": p.request_id})
        try:
            async with asyncio.timeout(p.cut_after_s), stream as response:
                arrivals.append(self.now())
                out.status = response.status_code
                if out.status != 200:
                    out.result, out.cause = _http_result(out.status, await response.aread(), response.headers)
                elif p.cut_after_chunks == 0:
                    out.result, out.cause = DISCONNECTED, "after the headers"
                else:
                    out.result = CUT  # until [DONE]
                    async for line in response.aiter_lines():
                        arrivals.append(self.now())
                        if _take(out, line, p, usage, arrivals[-1]):
                            break
        except asyncio.CancelledError:  # still open when the run ended, past every bound
            out.result, out.cause = HANG, "still open at the end of the run"
            raise
        except TimeoutError:
            out.result, out.cause = DISCONNECTED, "after a delay"
        except httpx.ReadTimeout:
            out.result, out.cause = HANG, "no byte within the read timeout"
            arrivals.append(self.now())
        except httpx.HTTPError as exc:
            out.result, out.cause = CUT if out.status == 200 else CLIENT_ERROR, type(exc).__name__
        finally:
            out.end_s = self.now()
            out.max_silence_s = max((b - a for a, b in zip(arrivals, arrivals[1:])), default=0.0)
            self.outcomes.append(out)
        return out


def _take(out: Outcome, line: str, planned: Planned, usage: list[int], now: float) -> bool:
    """Read one SSE line into ``out``; True when the client is done with the stream."""
    if not line.startswith("data: "):
        return False
    if (data := line.removeprefix("data: ")) == "[DONE]":
        if out.result != ERROR_EVENT:
            got, asked = usage[-1] if usage else out.num_tokens, planned.max_tokens
            out.result, out.cause = (COMPLETED, None) if got == asked else (SHORT, f"{got} of {asked} tokens")
        return True
    event = json.loads(data)
    if error := event.get("error"):
        out.result, out.cause = ERROR_EVENT, error.get("code") or str(error.get("message"))[:100]
        return False
    if event.get("usage"):
        usage.append(event["usage"]["completion_tokens"])
    if any(choice.get("text") for choice in event.get("choices", ())):
        out.num_tokens += 1
        out.first_token_s, out.last_token_s = now if out.first_token_s is None else out.first_token_s, now
        if planned.cut_after_chunks is not None and out.num_tokens >= planned.cut_after_chunks:
            out.result, out.cause = DISCONNECTED, f"after {out.num_tokens} chunks"
            return True
    return False


def _http_result(status: int, body: bytes, headers: httpx.Headers) -> tuple[str, str]:
    try:
        message = str(json.loads(body)["error"]["message"])[:100]
    except (ValueError, KeyError, TypeError):
        message = body[:100].decode(errors="replace")
    retry = f" (Retry-After: {headers['retry-after']})" if "retry-after" in headers else ""
    return {503: HTTP_503, 504: HTTP_504}.get(status, HTTP_4XX if status < 500 else HTTP_5XX), message + retry


class Prompts:
    """Exact-length prompts cut from the corpus (``workloads``), lengths drawn from a seeded RNG."""

    # (prompt, output) token ranges; the burst's requests come all at once on one prefill core: short ones
    RANGES = {"burst": ((16, 64), (8, 40)), "long": ((300, 440), (8, 32)), "plain": ((32, 160), (16, 64))}

    def __init__(self, seed: int) -> None:
        self.builder, self.rng = PromptBuilder(tokenizer()), random.Random(seed)

    def prompt(self, low: int, high: int) -> list[int]:
        return self.builder.summarization(self.rng.randint(low, high), self.rng.randrange(10_000))

    def plan(self, rid: str, phase: str, disconnect: float, long_share: float = 0.0) -> Planned:
        """A plain request (short, or long with ``long_share``), disconnected with ``disconnect``."""
        long = self.rng.random() < long_share
        (low, high), (out_low, out_high) = self.RANGES["burst" if phase == "burst" else "long" if long else "plain"]
        planned = Planned(rid, phase, "plain", self.prompt(low, high), self.rng.randint(out_low, out_high))
        if self.rng.random() >= disconnect:
            return planned
        if self.rng.random() < 0.5:
            return replace(planned, kind="disconnect", cut_after_chunks=self.rng.randrange(planned.max_tokens))
        return replace(planned, kind="disconnect", cut_after_s=self.rng.uniform(0.05, 8.0))


async def soak(client: Client, prompts: Prompts, watch: KVWatch, opts: argparse.Namespace) -> list[KillEvent]:
    """Poisson traffic for ``soak_s``, with the stalls and kills at their times; returns the kills."""
    start, rng, kills, tasks = client.now(), random.Random(opts.seed + 1), [], []
    every = {"kill": opts.kill_every_s, "stall": opts.stall_every_s}  # at 1, 2, ... periods, strictly before the end
    events = [(start + k * t, what) for what, t in every.items() for k in range(1, math.ceil(opts.soak_s / t))]
    at = start
    while (at := at + rng.expovariate(opts.rate)) < start + opts.soak_s:
        events.append((at, "plain"))
    for n, (at, what) in enumerate(sorted(events), 1):
        await asyncio.sleep(max(0.0, at - client.now()))
        if what == "plain":
            event = client.send(prompts.plan(f"{opts.mode}-s-{n}", "soak", opts.soak_disconnect, 0.2))
        elif what == "stall":
            event = client.send(Planned(f"stall-{n}", "soak", "stall", prompts.prompt(48, 96), 16))
        else:
            kind = ("prefill", "decode")[len(kills) % 2]
            kills.append(KillEvent(kind, f"kill-{kind}-{n}"))
            event = kill_replica(client, prompts, watch, kills[-1])
        tasks.append(asyncio.ensure_future(event))
    _, pending = await asyncio.wait(tasks, timeout=HANG_S + 240) if tasks else ((), ())  # each has a read timeout
    for task in pending:  # past every bound: counted as hangs by their absence
        task.cancel()
    return kills


async def kill_replica(client: Client, prompts: Prompts, watch: KVWatch, event: KillEvent) -> None:
    """Send the killing request, wait for the pool's new engine id, then send a probe."""
    pool = "PrefillServer" if event.kind == "prefill" else "DecodeServer"
    await watch.wait_new(pool, set(), timeout_s=120)  # the pool is up (a previous restart done)
    before = watch.live(pool)
    event.old_engine = next(iter(before), None)
    outcome = await client.send(Planned(event.request_id, "soak", f"kill-{event.kind}", prompts.prompt(48, 96), 32))
    new = await watch.wait_new(pool, before, timeout_s=180)
    by_client = outcome.last_token_s if event.kind == "decode" and outcome.result == ERROR_EVENT else None
    event.crash_s = by_client if by_client is not None else watch.seen(event.old_engine, "last_seen_s") if new else None
    if new is not None:
        event.new_engine, event.restarted_s = new, watch.seen(new, "first_seen_s")
        await client.send(Planned(f"probe-{event.request_id}", "soak", "probe", prompts.prompt(32, 64), 16))


class KVWatch:
    """Reads ``GET /admin/kv`` every second: engine ids (a restart is a new one), memory, violations, blocks held."""

    def __init__(self, client: Client, warmup_s: float) -> None:
        self.client, self.warmup_s, self.engines = client, warmup_s, dict[str, EngineMemory]()
        self.view, self.violations, self.failures = {"ok": True, "replicas": []}, list[dict](), 0  # failures: not 200
        self.warm_from_s = float("inf")  # memory after warm-up: counted from the soak's start

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(1.0)

    async def poll(self) -> None:
        try:
            response = (await self.client.http.get("/admin/kv", timeout=10)).raise_for_status()
        except httpx.HTTPError:
            self.failures += 1
            return
        self.view = response.json()
        for entry in (e for e in self.view["replicas"] if e["live"]):
            self._record(entry)

    def _record(self, entry: dict[str, Any]) -> None:
        at, rss, engine_id = entry["published_at"] - self.client.wall0, entry.get("rss_bytes"), entry["engine_id"]
        engine = self.engines.setdefault(engine_id, EngineMemory(engine_id, entry["deployment"], at, at))
        engine.last_seen_s, engine.last_rss = max(engine.last_seen_s, at), rss
        if engine.warm_s is None and at >= max(engine.first_seen_s, self.warm_from_s) + self.warmup_s:
            engine.warm_s, engine.warm_rss = at, rss
        problems = list(entry.get("problems") or [])
        if not entry["ok"] and (engine_id, problems) not in [(v["engine_id"], v["problems"]) for v in self.violations]:
            row = {"t_s": round(at, 1), "engine_id": engine_id, "deployment": entry["deployment"]}
            self.violations.append({**row, "problems": problems})

    def seen(self, engine_id: str | None, when: str) -> float | None:
        """``first_seen_s`` or ``last_seen_s`` of an engine; None for one never seen."""
        return getattr(self.engines[engine_id], when) if engine_id in self.engines else None

    def live(self, pool: str) -> set[str]:
        return {e["engine_id"] for e in self.view["replicas"] if e["live"] and e["deployment"] == pool}

    async def wait_new(self, pool: str, before: set[str], timeout_s: float) -> str | None:
        """The id of a live engine of ``pool`` not in ``before`` (the restarted one)."""
        deadline = self.client.now() + timeout_s
        while self.client.now() < deadline:
            if new := self.live(pool) - before:
                return min(new, key=lambda e: self.seen(e, "first_seen_s") or 0.0)
            await asyncio.sleep(0.5)
        return None

    def leak_check(self) -> dict[str, Any]:
        live = [e for e in self.view["replicas"] if e["live"]]
        held = sum(e["num_in_use_blocks"] for e in live)
        return {"held_blocks": held, "settled_s": None, "ok": bool(self.view["ok"]),
                "live": sorted({e["deployment"] for e in live})}  # fmt: skip

    async def settle(self, timeout_s: float = TIMEOUT_S + 70) -> dict[str, Any]:
        """The leak check once both pools' live replicas hold no block (leases end in ``TIMEOUT_S``), or at timeout."""
        start = self.client.now()
        while True:
            check = self.leak_check()
            if check["held_blocks"] == 0 and check["ok"] and check["live"] == sorted(POOLS):
                return check | {"settled_s": round(self.client.now() - start, 1)}
            if self.client.now() - start > timeout_s:
                return check
            await asyncio.sleep(1.0)


async def run_phases(url: str, model: str, opts: argparse.Namespace, specs: list[dict]) -> dict[str, Any]:
    client = Client(url, model, specs)
    prompts, watch = Prompts(opts.seed), KVWatch(client, opts.warmup_s)
    watcher, phases = asyncio.ensure_future(watch.run()), {}
    try:
        for i in range(3):
            await client.send(Planned(f"warmup-{i}", "warmup", "plain", prompts.prompt(32, 64), 8))
        start = client.now()
        plans = [prompts.plan(f"{opts.mode}-b-{i}", "burst", opts.burst_disconnect) for i in range(opts.concurrency)]
        await asyncio.gather(*(client.send(p) for p in plans))
        phases["burst"] = (client.now() - start, await watch.settle())
        watch.warm_from_s = start = client.now()
        kills = await soak(client, prompts, watch, opts)
        phases["soak"] = (client.now() - start, await watch.settle())
        print(f"leak checks: {phases}", file=sys.stderr)
        await watch.poll()
        for engine in watch.engines.values():
            engine.live_at_end = engine.engine_id in watch.live(engine.deployment)
    finally:
        watcher.cancel()
        await client.http.aclose()
    return {"outcomes": client.outcomes, "phases": phases, "kills": kills, "watch": watch}


def summarize(opts: argparse.Namespace, specs: list[dict], result: dict[str, Any], logs: dict[str, Any]) -> dict:
    settings = {k: v for k, v in vars(opts).items() if k not in ("out", "raw", "quick")}
    settings |= {"kv_transfer_timeout_s": TIMEOUT_S, "stream_idle_timeout_s": STREAM_IDLE_S}
    summary = {
        "mode": opts.mode, "command": command_line(NAME), "machine": machine(),
        "ray": ray.__version__, "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "settings": settings | {"app_args": app_args(opts.mode, specs)}, "faults": specs,
    }  # fmt: skip
    for phase, (seconds, leak) in result["phases"].items():
        summary[phase] = phase_summary([o for o in result["outcomes"] if o.phase == phase], leak, specs, seconds)
    soaked, watch = [o for o in result["outcomes"] if o.phase == "soak"], result["watch"]
    return summary | {"kills": [kill_summary(k, soaked) for k in result["kills"]],
                      "memory": memory_rows(list(watch.engines.values())), "invariant_violations": watch.violations,
                      "admin_kv_failures": watch.failures, "logs": logs}  # fmt: skip


def result_counts(outcomes: list[Outcome]) -> dict[str, int]:
    counts = Counter(o.result for o in outcomes)
    return {r: counts[r] for r in RESULT_ORDER if counts[r]}


def cause_counts(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """Rows (result, cause, before/after the first token, count) of the requests not completed."""
    when = ("before a token", "after tokens")
    counts = Counter((o.result, o.cause or "", when[o.num_tokens > 0]) for o in outcomes if o.result != COMPLETED)
    rows = [{"result": r, "cause": c, "when": w, "count": n} for (r, c, w), n in counts.items()]
    return sorted(rows, key=lambda row: (RESULT_ORDER.index(row["result"]), -row["count"]))


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _e2e(outcomes: list[Outcome]) -> list[float]:
    return [o.end_s - o.sent_s for o in outcomes if o.result == COMPLETED]


def phase_summary(outcomes: list[Outcome], leak: dict | None, faults: list[dict], duration_s: float) -> dict:
    """One phase: counts by result and cause, per random fault (not disconnects) and per kind; latencies; silences."""
    e2e, plain = _e2e(outcomes), _group([o for o in outcomes if not o.faults and o.kind == "plain"])["median_e2e_s"]
    met = {s["name"]: [o for o in outcomes if s["name"] in o.faults and o.kind != "disconnect"] for s in faults
           if s["kind"] == "random"}  # fmt: skip
    kinds = {kind: [o for o in outcomes if o.kind == kind] for kind in ("disconnect", "stall")}
    ttfts = [o.first_token_s - o.sent_s for o in outcomes if o.result == COMPLETED and o.first_token_s is not None]
    return _group(outcomes) | {
        "duration_s": round(duration_s, 1), "causes": cause_counts(outcomes), "leak": leak,
        "faults": [_group(mine, fault=name) | {"plain_median_e2e_s": plain} for name, mine in met.items()],
        "kinds": [_group(mine, kind=kind) for kind, mine in kinds.items() if mine],
        "p90_e2e_s": round(statistics.quantiles(e2e, n=10)[-1], 3) if e2e[1:] else None,
        "median_ttft_s": _median(ttfts), "hangs": sum(o.result == HANG for o in outcomes), "hang_bound_s": HANG_S,
        "long_silences": sum(o.max_silence_s > LONG_S for o in outcomes), "long_silence_s": LONG_S,
        "max_silence_s": round(max((o.max_silence_s for o in outcomes), default=0.0), 3),
        "anomalies": [asdict(o) for o in outcomes if o.result in ANOMALIES],
    }  # fmt: skip


def _group(outcomes: list[Outcome], **name: str) -> dict[str, Any]:
    median = _median(_e2e(outcomes))
    return name | {"requests": len(outcomes), "results": result_counts(outcomes), "median_e2e_s": median}


def kill_summary(kill: KillEvent, outcomes: list[Outcome]) -> dict[str, Any]:
    """One kill: what its request and those in flight or sent before the restart saw; restart and recovery."""
    own = next((o for o in outcomes if o.request_id == kill.request_id), None)
    saw = own and {"result": own.result, "cause": own.cause, "tokens": own.num_tokens}
    row: dict[str, Any] = {**asdict(kill), "client_saw": saw, "affected": {}, "restart_s": None, "recover_s": None}
    if kill.crash_s is None:
        return row
    until = kill.restarted_s if kill.restarted_s is not None else math.inf
    others = [o for o in outcomes if o.request_id != kill.request_id and o.sent_s < until]
    row["affected"] = result_counts([o for o in others if o.end_s is None or o.end_s >= kill.crash_s])

    def first_ok_after(t: float) -> float | None:
        ends = [o.end_s for o in outcomes if o.sent_s >= t and o.result == COMPLETED]
        return round(min(ends) - kill.crash_s, 3) if ends else None

    row["first_ok_after_crash_s"] = first_ok_after(kill.crash_s)
    if kill.restarted_s is not None:
        row["restart_s"], row["recover_s"] = round(kill.restarted_s - kill.crash_s, 3), first_ok_after(kill.restarted_s)
    return row


def memory_rows(engines: list[EngineMemory]) -> list[dict[str, Any]]:
    return [asdict(e) | {"growth": e.growth} for e in sorted(engines, key=lambda e: (e.deployment, e.first_seen_s))]


def verdict(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets against what was measured: (check, target, measured, met)."""
    phases = [summary["burst"], summary["soak"]]
    leaks = [p["leak"]["held_blocks"] if p["leak"] else None for p in phases]
    growth = max((m["growth"] for m in summary["memory"] if m["growth"] is not None), default=None)
    anomalies, hangs = sum(len(p["anomalies"]) for p in phases), sum(p["hangs"] for p in phases)
    violations, recovered = len(summary["invariant_violations"]), [k["recover_s"] is not None for k in summary["kills"]]
    rows = [
        ("blocks leaked (each phase, after the leases)", "0", "/".join(map(str, leaks)), all(x == 0 for x in leaks)),
        ("invariant violations seen in /admin/kv", "0", str(violations), violations == 0),
        ("hangs", "0", str(hangs), hangs == 0),
        ("silent cuts, short streams, 500s, client errors", "0", str(anomalies), anomalies == 0),
        ("memory growth of the replicas, after warm-up to end", f"<= {MEMORY_GROWTH_LIMIT:.0%}",
         "n/a" if growth is None else f"max {growth:+.1%}", growth is not None and growth <= MEMORY_GROWTH_LIMIT),
        ("every kill recovered (a request on the restarted replica completed)", "all",
         f"{sum(recovered)} of {len(recovered)}", all(recovered)),
    ]  # fmt: skip
    return [{"check": c, "target": t, "measured": m, "met": ok} for c, t, m, ok in rows]


def scan_logs(log_dir: Path) -> dict[str, Any]:
    """The Ray session's ``serve/*.log`` and workers' ``*.err`` (a line in both counted once): the expected
    events counted; tracebacks, errors and warnings not expected counted by kind and text, Serve's own apart."""
    counts: dict[str, Counter] = {k: Counter() for k in ("expected", *LOG_KINDS)}
    controllers = {p.stem.split("_")[-1] for p in log_dir.glob("serve/controller_*.log")}
    seen: set[str] = set()
    for path in (p for p in serve_logs(log_dir) if p.suffix == ".log" or p.stem.split("-")[-1] not in controllers):
        lines = path.read_text(errors="replace").splitlines()
        components = Counter(m.group(2) for m in map(SERVE_LINE.match, lines) if m)
        prefix = path.stem.split("_")[0]
        source = components.most_common(1)[0][0] if components else prefix if prefix in SERVE_COMPONENTS else path.name
        for i, line in enumerate(lines):
            match = SERVE_LINE.match(line)
            if line.startswith("Traceback (most recent call last)"):  # as its exception line: the next unindented
                tail = next((t for t in lines[i + 1 :] if t and not t[0].isspace()), "(end of file)")
                _count(counts, source, "traceback: " + tail[:200])
            elif match is not None and line in seen:
                continue
            elif name := next((name for name, text in EXPECTED_LOG.items() if text in line), None):
                counts["expected"][name] += 1
            elif match is not None and match.group(1) in ("WARNING", "ERROR", "CRITICAL"):
                _count(counts, match.group(2), line.split(" -- ", 1)[-1][:200], warning=match.group(1) == "WARNING")
            seen.add(line)
    expected = {n: counts["expected"][n] for n in EXPECTED_LOG if counts["expected"][n]}
    summary: dict[str, Any] = {"dir": str(log_dir), "expected": expected}
    for key in LOG_KINDS:
        summary[f"{key}_count"] = sum(counts[key].values())
        summary[key] = [{"line": k, "count": v} for k, v in counts[key].most_common(30)]
    return summary


def _count(counts: dict[str, Counter], source: str, text: str, warning: bool = False) -> None:
    message = f"{source}: {re.sub(r'[0-9a-f]{16,}', '<id>', text)}"
    if warning:  # grouped by shape: numbers (ids, times) left out
        message = re.sub(r"\d+(\.\d+)?", "N", message)
    kind = "serve_internal" if source in SERVE_COMPONENTS else "other_warnings" if warning else "unexpected"
    counts[kind][message] += 1


def save(out: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """Merge this mode's summary into ``benchmarks/reliability.json``; render ``reliability.md`` from all modes."""
    path = out / "benchmarks" / "reliability.json"
    write_json(path, (read_json(path) if path.exists() else {}) | {summary["mode"]: summary}, sort_keys=True)
    merged = read_json(path)  # rendered as a re-render from the file will see it
    title = "# Reliability: load and soak with faults, through the HTTP API"
    write_page(out / "reliability.md", NAME, render(merged), template(NAME, title))
    return merged


def _counts(results: dict[str, int]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in results.items()) or "-"


def _span(values: list[float | None]) -> str:
    known = sorted(v for v in values if v is not None)
    return "-" if not known else f"{known[0]:.1f} s" if len(known) == 1 else f"{known[0]:.1f}-{known[-1]:.1f} s"


def _fault_row(summary: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    """A per-fault row: rules, requests met, what the client saw, time to recover, blocks leaked after."""
    killing = spec["kind"].startswith("kill-")
    phases = [p for p in (("soak",) if killing else ("burst", "soak")) if summary[p]["leak"]]
    leaks = ", ".join(f"{summary[p]['leak']['held_blocks']} ({p})" for p in phases) or "-"
    rules = [", ".join(f"{k}={r[k]}" for k in sorted(r, key=lambda k: (RULE_KEYS.get(k, 9), k)) if r[k] is not None)
             for r in spec["rules"]]  # fmt: skip
    head = [f"{spec['name']}: {spec['effect']}", "<br>".join(f"`{text}`" for text in rules) or "-"]
    if killing:
        kills = [k for k in summary["kills"] if k["kind"] == spec["kind"].removeprefix("kill-")]
        own = Counter(f"{s.get('result')} ({s.get('cause') or 'ok'})" for s in (k["client_saw"] or {} for k in kills))
        affected = sum((Counter(k["affected"]) for k in kills), Counter())
        seen = f"its request: {', '.join(f'{k} x{v}' for k, v in own.items())}; others: {_counts(dict(affected))}"
        spans = [_span([k[key] for k in kills]) for key in ("restart_s", "recover_s")]
        return [*head, f"{len(kills)} kills", seen, "restart {}, recovered {}".format(*spans), leaks]
    key, name = ("fault", spec["name"]) if spec["kind"] == "random" else ("kind", spec["kind"])
    found = [(p, r) for p in ("burst", "soak") for r in summary[p][key + "s"] if r[key] == name]
    results = sum((Counter(row["results"]) for _, row in found), Counter())
    if spec["kind"] == "disconnect":
        recover = "-"
    elif spec["kind"] == "random":
        medians = [f"{p} {secs(r['median_e2e_s'])} (no fault {secs(r['plain_median_e2e_s'])})" for p, r in found]
        recover = "in the request; median E2E " + ", ".join(medians)
    else:
        recover = f"in the request; median E2E {_span([r['median_e2e_s'] for _, r in found])}"
    return [*head, str(sum(r["requests"] for _, r in found)), _counts(dict(results)), recover, leaks]


def _phase_lines(name: str, phase: dict[str, Any]) -> list[str]:
    times = {k: secs(phase[k], 2) for k in ("median_e2e_s", "p90_e2e_s", "median_ttft_s")}
    lines = [cells(PHASE_LINE, phase | times | {"name": name, "max_silence_s": secs(phase["max_silence_s"])}), ""]
    rows = [[COMPLETED, "", "", str(phase["results"].get(COMPLETED, 0))]]
    rows += [[c["result"], f"`{c['cause']}`" if c["cause"] else "", c["when"], c["count"]] for c in phase["causes"]]
    lines += table("outcome | cause | when | requests", rows)
    if leak := phase["leak"]:
        settled = "never" if leak["settled_s"] is None else f"after {leak['settled_s']:.0f} s"
        lines += ["", f"After the phase: {leak['held_blocks']} blocks held on the live replicas ({settled}), "
                  f"invariants {'held' if leak['ok'] else 'VIOLATED'}, live: {', '.join(leak['live'])}."]  # fmt: skip
    return lines


def render_mode(summary: dict[str, Any]) -> list[str]:
    s, checks = summary["settings"], verdict(summary)
    lines = [
        f"## {summary['mode']} mode", "", f"Command: `{summary['command']}`  ",
        f"Run {summary['date']} on {summary['machine']}, Ray {summary['ray']}.  ",
        f"Setup: 1 prefill + 1 decode replica, `transport.kv_transfer_timeout_s={s['kv_transfer_timeout_s']:g}`, "
        f"burst of {s['concurrency']} concurrent streams ({s['burst_disconnect']:.0%} disconnected at random "
        f"points), then a {s['soak_s']:.0f} s soak at {s['rate']:g} req/s Poisson ({s['soak_disconnect']:.0%} "
        f"disconnected), a kill every {s['kill_every_s']:.0f} s (prefill and decode in turn), a stalled transfer "
        f"every {s['stall_every_s']:.0f} s.", "", "### Targets", "",
        *table("check | target | measured | met", [cells(TARGET_ROW, v | {"met": YES[v["met"]]}) for v in checks]),
        "", "### Per fault", "",
        *table("fault | rules (`faults:`) | met | what the client saw | time to recover | blocks leaked after",
               [_fault_row(summary, spec) for spec in [*summary["faults"], DISCONNECT]]),
        "", "### Requests by outcome", "", *_phase_lines("Burst", summary["burst"]), "",
        *_phase_lines("Soak", summary["soak"]),
    ]  # fmt: skip
    kills, memory, logs = [], [], summary["logs"]
    for n, kill in enumerate(summary["kills"], 1):
        saw = kill["client_saw"] or {}
        cause = f" `{saw['cause']}`" if saw.get("cause") else ""
        own = f"{saw.get('result')}{cause} after {saw.get('tokens')} text chunks"
        times = [secs(kill["restart_s"]), secs(kill.get("first_ok_after_crash_s")), secs(kill["recover_s"])]
        kills.append([n, kill["kind"], f"`{kill['request_id']}`", own, _counts(kill["affected"]), *times])
    for m in summary["memory"]:
        growth = "not judged (< 60 s)" if m["growth"] is None else f"{m['growth']:+.1%}"
        state = "live at the end" if m["live_at_end"] else f"gone at {m['last_seen_s']:.0f} s (killed)"
        rss = ["-" if v is None else f"{v / 2**20:.0f}" for v in (m["warm_rss"], m["last_rss"])]
        memory.append([m["deployment"], f"`{m['engine_id'][:12]}`", f"{max(0.0, m['first_seen_s']):.0f} s", state,
                       *rss, growth])  # fmt: skip
    lines += ["", "### Kills", "", *table(KILLS, kills), "", "### Memory", "", *table(MEMORY, memory), "", "### Logs",
              "", f"From the Ray session's `logs/serve/*.log` and `worker-*.err` (kept in `{logs.get('dir')}`):",
              ""]  # fmt: skip
    lines += [f"- {name}: {logs['expected'][name]} lines" for name in EXPECTED_LOG if name in logs.get("expected", {})]
    for key, title in LOG_KINDS.items():
        lines.append(f"- {title}: {logs.get(key + '_count', 0)}")
        lines += [f"  - {row['count']} x `{row['line']}`" for row in logs.get(key, [])[:10]]
    if anomalies := [a for p in ("burst", "soak") for a in summary[p]["anomalies"]]:
        lines += ["", "Requests that ended outside the contract (hangs, silent cuts, 500s, client errors):", ""]
        rows = [[f"`{a['request_id']}`", a["result"], a["cause"] or "", secs(a["sent_s"]), secs(a["end_s"]),
                 a["num_tokens"]] for a in anomalies]  # fmt: skip
        lines += table("request | result | cause | sent | ended | text chunks", rows)
    if violations := summary["invariant_violations"]:
        lines += ["", "Invariant violations seen:", ""]
        lines += [f"- {v['t_s']:.0f} s, {v['deployment']} `{v['engine_id'][:12]}`: {v['problems']}" for v in violations]
    return lines


def render(merged: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["", "Generated by `python -m bench.reliability` (`bench/reliability.py`); the numbers are in "
             "`docs/benchmarks/reliability.json`."]  # fmt: skip
    for mode in sorted(merged, key=lambda m: (m != "pull", m)):
        lines += ["", *render_mode(merged[mode])]
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = arguments(NAME, __doc__)
    parser.add_argument("--mode", choices=("pull", "push"), default="pull")
    parser.add_argument("--concurrency", type=int, default=200, help="streams of the burst")
    parser.add_argument("--burst-disconnect", type=float, default=0.3, help="share of the burst the client cuts")
    parser.add_argument("--soak-s", type=float, default=600.0)
    parser.add_argument("--rate", type=float, default=1.0, help="soak arrivals (req/s, Poisson)")
    parser.add_argument("--soak-disconnect", type=float, default=0.1)
    parser.add_argument("--kill-every-s", type=float, default=150.0, help="a replica killed this often (in turn)")
    parser.add_argument("--stall-every-s", type=float, default=90.0, help="a transfer stalled past its lease")
    parser.add_argument("--warmup-s", type=float, default=60.0, help="memory is first read this long into the soak")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="docs folder (default docs; --quick: /tmp/reliability_quick)")
    parser.add_argument("--raw", help="every request's outcome as JSON (default /tmp/reliability_raw_<mode>.json)")
    parser.add_argument("--quick", action="store_true", help="a small smoke run: " + json.dumps(QUICK))
    if parser.parse_known_args(argv)[0].quick:  # QUICK's values replace the defaults, not what was given
        parser.set_defaults(**QUICK)
    opts = parser.parse_args(argv)
    opts.out = Path(opts.out or ("/tmp/reliability_quick" if opts.quick else "docs"))
    opts.raw = Path(opts.raw or f"/tmp/reliability_raw_{opts.mode}.json")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    specs, keep_logs = fault_specs(opts.mode), Path(f"/tmp/reliability_logs_{opts.mode}")
    with Server("disagg", app_args(opts.mode, specs), port=HTTP_PORT, name="reliability", keep_logs=keep_logs) as srv:
        result = asyncio.run(run_phases(srv.url, srv.model(), opts, specs))
    summary = summarize(opts, specs, result, scan_logs(keep_logs))
    write_json(opts.raw, [asdict(o) for o in result["outcomes"]], indent=0)
    save(opts.out, summary)
    print(f"wrote {opts.out / 'reliability.md'}; logs kept in {keep_logs}", file=sys.stderr)


if __name__ == "__main__":
    main()
