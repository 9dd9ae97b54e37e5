"""Load and soak with faults, through the HTTP API: ``python -m bench.reliability``.

Starts ``disagg_app`` (1 prefill + 1 decode replica, fixed pools, ``kv_transfer_timeout_s``
20 s) in its own local Ray with the faults below in its ``faults:`` configuration, then:

1. **burst**: ``--concurrency`` streamed requests at once, a share of them
   (``--burst-disconnect``) closed by the client at a random point (after k chunks or after a
   random delay); then, once the KV leases ran out, ``GET /admin/kv`` must show no block held
   and every invariant holding.
2. **soak**: ``--soak-s`` seconds of Poisson traffic at ``--rate`` (mixed lengths, some
   disconnects), 5% of requests meeting each probabilistic fault, a stalled transfer every
   ``--stall-every-s`` and a replica killed every ``--kill-every-s`` (prefill and decode in
   turn, by requests whose id carries the fault rule's prefix); then the same leak check.

Each request's outcome is what the client saw (``bench.reliability_report``); a hang is no
byte for longer than the service's own bounds plus 15 s (the client's read timeout).
``/admin/kv`` is read every second: invariants, engine ids (restarts) and each replica's
resident memory. Writes ``<out>/benchmarks/reliability.json`` and ``<out>/reliability.md``
(``--quick``: a small smoke run into /tmp/reliability_quick).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.reliability_report import (
    CLIENT_ERROR,
    COMPLETED,
    CUT,
    DISCONNECTED,
    ERROR_EVENT,
    HANG,
    HELD_FIELDS,
    HTTP_4XX,
    HTTP_5XX,
    HTTP_503,
    HTTP_504,
    SHORT,
    Bounds,
    EngineMemory,
    FaultSpec,
    KillEvent,
    LeakCheck,
    Outcome,
    kill_summary,
    memory_rows,
    phase_summary,
    save,
    scan_logs,
)

HTTP_PORT = 18660
MAX_MODEL_LEN = 512
TIMEOUT_S = 20.0  # transport.kv_transfer_timeout_s
PEER_CHECK_S = 5.0
STREAM_IDLE_S = 60.0  # limits.stream_idle_timeout_s (the default)
SLACK_S = 15.0
POOLS = ("PrefillServer", "DecodeServer")


def fault_specs(mode: str) -> list[FaultSpec]:
    """The faults of a run: probabilistic ones at 5% of requests each, and ones selected by
    a request id prefix (the script sends those requests when it wants the fault)."""
    transfer = "fetch" if mode == "pull" else "push_layer"
    slow = "fetch" if mode == "pull" else "finish_push"
    specs = [
        FaultSpec("transfer failure", "random", [_rule(transfer, "fail", probability=0.05)], "the transfer raises"),
        FaultSpec(
            "slow transfer", "random", [_rule(slow, "delay", seconds=3.0, probability=0.05)], "the transfer waits 3 s"
        ),
    ]
    if mode == "pull":
        drop = _rule("release", "drop", probability=0.05)
        specs.append(FaultSpec("dropped release notice", "random", [drop], "the producer frees at the lease's end"))
    stall = _rule(slow, "delay", seconds=TIMEOUT_S + 1, request_id_prefix="stall-")
    specs.append(FaultSpec("stalled transfer (past the lease)", "stall", [stall], "the transfer outlives its lease"))
    if mode == "pull":  # crash 50 ms after the export; the fetch held 1 s: the crash lands mid-transfer
        kill = [
            _rule("after_export", "crash", request_id_prefix="kill-prefill-", max_times=None),
            _rule("fetch", "delay", seconds=1.0, request_id_prefix="kill-prefill-"),
        ]
    else:
        kill = [_rule("push_layer", "crash", layer=15, request_id_prefix="kill-prefill-", max_times=None)]
    specs.append(FaultSpec("prefill replica killed mid-transfer", "kill-prefill", kill, "SIGKILL"))
    decode = _rule("mid_decode", "crash", request_id_prefix="kill-decode-", after_tokens=4, max_times=None)
    specs.append(FaultSpec("decode replica killed mid-stream", "kill-decode", [decode], "SIGKILL after 4 tokens"))
    return specs


def _rule(point: str, action: str, **fields: Any) -> dict[str, Any]:
    return {"point": point, "action": action, **fields}


def app_args(mode: str, specs: list[FaultSpec]) -> dict[str, str]:
    rules = [rule for spec in specs for rule in spec.rules]
    return {
        "model.max_model_len": str(MAX_MODEL_LEN),
        "prefill.num_cpus": "0.25",
        "decode.num_cpus": "0.25",
        "autoscaling.enabled": "false",
        "transport.mode": mode,
        "transport.kv_transfer_timeout_s": str(TIMEOUT_S),
        "transport.peer_check_interval_s": str(PEER_CHECK_S),
        "limits.stream_idle_timeout_s": str(STREAM_IDLE_S),
        "faults": json.dumps(rules),
    }


# ---- the server ------------------------------------------------------------------------------


class Server:
    """disagg_app in its own local Ray (2 CPUs), stopped on exit; its logs copied to ``keep_logs``."""

    def __init__(self, args: dict[str, str], keep_logs: Path) -> None:
        self.args, self.keep_logs = args, keep_logs
        self.url = f"http://127.0.0.1:{HTTP_PORT}"
        self.log_dir: Path | None = None

    def __enter__(self) -> Server:
        import ray
        from ray import serve

        from app.config import disagg_app
        from bench.ray_local import start_local_ray

        signal.signal(signal.SIGTERM, _exit_on_signal)
        start_local_ray(num_cpus=2)
        self.log_dir = Path(ray._private.worker._global_node.get_logs_dir_path())
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": HTTP_PORT})
            serve.run(disagg_app(dict(self.args)), name="reliability", route_prefix="/")
            deadline = time.monotonic() + 240
            while not _ready(self.url):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.url}/ready did not answer 200 within 240 s")
                time.sleep(0.5)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
        if self.log_dir is not None:
            shutil.rmtree(self.keep_logs, ignore_errors=True)
            shutil.copytree(self.log_dir, self.keep_logs, ignore=shutil.ignore_patterns("*.sock"), dirs_exist_ok=True)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(f"stopped by signal {signum}")


# ---- one request -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """A request to send: a disconnect closes the stream after ``cut_after_chunks`` text
    chunks (0: right after the headers) or after ``cut_after_s``, whichever comes first."""

    request_id: str
    phase: str
    kind: str
    prompt: list[int]
    max_tokens: int
    cut_after_chunks: int | None = None
    cut_after_s: float | None = None


class Client:
    """Streams requests and records what it saw; the run's clock starts at construction."""

    def __init__(self, url: str, model: str, specs: list[FaultSpec], hang_s: float) -> None:
        from app.settings import AppConfig
        from kv_transport.faults import FaultPoints

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(connect=10.0, read=hang_s, write=30.0, pool=None)
        self.http = httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits)
        self.model, self.hang_s = model, hang_s
        rules = [rule for spec in specs for rule in spec.rules]
        self._points = FaultPoints(AppConfig.model_validate({"faults": rules}).faults)
        names = [spec.name if spec.kind == "random" else None for spec in specs for _ in spec.rules]
        self._random = [(i, name) for i, name in enumerate(names) if name is not None]
        self.t0, self.wall0 = time.monotonic(), time.time()
        self.outcomes: list[Outcome] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def drawn(self, request_id: str) -> tuple[str, ...]:
        """The probabilistic faults this request id meets (the server draws the same way)."""
        rules = self._points.rules
        return tuple(
            name
            for i, name in self._random
            if i in {j for j, _ in self._points.selected(rules[i].point, request_id, rules[i].layer)}
        )

    async def send(self, planned: Planned) -> Outcome:
        out = Outcome(
            planned.request_id, planned.phase, planned.kind, self.drawn(planned.request_id),
            len(planned.prompt), planned.max_tokens, self.now(),
        )  # fmt: skip
        last_byte = [out.sent_s]  # this request's: when its last byte came
        try:
            async with asyncio.timeout(planned.cut_after_s):
                await self._exchange(planned, out, last_byte)
        except asyncio.CancelledError:  # still open when the run ended, past every bound
            out.result, out.cause, out.end_s = HANG, "still open at the end of the run", self.now()
            self.outcomes.append(out)
            raise
        except TimeoutError:
            out.result, out.cause = DISCONNECTED, "after a delay"
        except httpx.ReadTimeout:
            out.result, out.cause = HANG, "no byte within the read timeout"
            out.max_silence_s = max(out.max_silence_s, self.now() - last_byte[0])
        except httpx.HTTPError as exc:
            out.result = CUT if out.status == 200 else CLIENT_ERROR
            out.cause = type(exc).__name__
        out.end_s = self.now()
        self.outcomes.append(out)
        return out

    async def _exchange(self, planned: Planned, out: Outcome, last_byte: list[float]) -> None:
        body = {
            "model": self.model,
            "prompt": planned.prompt,
            "max_tokens": planned.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"X-Request-Id": planned.request_id}
        async with self.http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            self._tick(out, last_byte)
            out.status = response.status_code
            if out.status != 200:
                out.result, out.cause = _http_result(out.status, await response.aread(), response.headers)
                return
            out.result = CUT  # until [DONE]
            if planned.cut_after_chunks == 0:
                out.result, out.cause = DISCONNECTED, "after the headers"
                return
            usage: list[int] = []
            async for line in response.aiter_lines():
                self._tick(out, last_byte)
                if _take(out, line, planned, usage, self.now()):
                    return

    def _tick(self, out: Outcome, last_byte: list[float]) -> None:
        now = self.now()
        out.max_silence_s = max(out.max_silence_s, now - last_byte[0])
        last_byte[0] = now


def _take(out: Outcome, line: str, planned: Planned, usage: list[int], now: float) -> bool:
    """Read one SSE line into ``out``; True when the client is done with the stream."""
    if not line.startswith("data: "):
        return False
    data = line[len("data: ") :]
    if data == "[DONE]":
        if out.result != ERROR_EVENT:
            got = usage[-1] if usage else out.num_tokens
            out.result = COMPLETED if got == planned.max_tokens else SHORT
            out.cause = None if out.result == COMPLETED else f"{got} of {planned.max_tokens} tokens"
        return True
    event = json.loads(data)
    if "error" in event:
        error = event["error"]
        out.result, out.cause = ERROR_EVENT, error.get("code") or str(error.get("message"))[:100]
        return False
    if event.get("usage"):
        usage.append(event["usage"]["completion_tokens"])
    if any(choice.get("text") for choice in event.get("choices", ())):
        out.num_tokens += 1
        out.first_token_s = out.first_token_s if out.first_token_s is not None else now
        out.last_token_s = now
        if planned.cut_after_chunks is not None and out.num_tokens >= planned.cut_after_chunks:
            out.result, out.cause = DISCONNECTED, f"after {out.num_tokens} chunks"
            return True
    return False


def _http_result(status: int, body: bytes, headers: httpx.Headers) -> tuple[str, str]:
    try:
        message = str(json.loads(body)["error"]["message"])[:100]
    except (ValueError, KeyError, TypeError):
        message = body[:100].decode(errors="replace")
    if "retry-after" in headers:
        message += f" (Retry-After: {headers['retry-after']})"
    kinds = {503: HTTP_503, 504: HTTP_504}
    return kinds.get(status, HTTP_4XX if status < 500 else HTTP_5XX), message


# ---- the phases ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    mode: str
    concurrency: int
    burst_disconnect: float
    soak_s: float
    rate: float
    soak_disconnect: float
    kill_every_s: float
    stall_every_s: float
    warmup_s: float
    seed: int
    out: Path
    raw: Path


class Prompts:
    """Exact-length prompts cut from the corpus (``workloads``), lengths drawn from a seeded RNG."""

    def __init__(self, seed: int) -> None:
        from engine.loader import ModelSpec, load_tokenizer
        from workloads import PromptBuilder

        self.builder = PromptBuilder(load_tokenizer(ModelSpec(source="default")))
        self.rng = random.Random(seed)

    def prompt(self, low: int, high: int) -> list[int]:
        return self.builder.summarization(self.rng.randint(low, high), self.rng.randrange(10_000))

    def plan(self, rid: str, phase: str, disconnect: float, long_share: float = 0.0) -> Planned:
        """A plain request (short, or long with ``long_share``), disconnected with ``disconnect``."""
        long = self.rng.random() < long_share
        if phase == "burst":  # 200 prompts at once on one prefill core: short ones
            prompt, max_tokens = self.prompt(16, 64), self.rng.randint(8, 40)
        elif long:
            prompt, max_tokens = self.prompt(300, 440), self.rng.randint(8, 32)
        else:
            prompt, max_tokens = self.prompt(32, 160), self.rng.randint(16, 64)
        planned = Planned(rid, phase, "plain", prompt, max_tokens)
        if self.rng.random() >= disconnect:
            return planned
        if self.rng.random() < 0.5:
            return replace(planned, kind="disconnect", cut_after_chunks=self.rng.randrange(max_tokens))
        return replace(planned, kind="disconnect", cut_after_s=self.rng.uniform(0.05, 8.0))


async def burst(client: Client, prompts: Prompts, opts: Options) -> list[Outcome]:
    plans = [prompts.plan(f"{opts.mode}-b-{i}", "burst", opts.burst_disconnect) for i in range(opts.concurrency)]
    return list(await asyncio.gather(*(client.send(p) for p in plans)))


class Soak:
    """Poisson traffic for ``soak_s``, with the stalls and kills at their times."""

    def __init__(self, client: Client, prompts: Prompts, watch: KVWatch, opts: Options) -> None:
        self.client, self.prompts, self.watch, self.opts = client, prompts, watch, opts
        self.kills: list[KillEvent] = []
        self.tasks: set[asyncio.Task] = set()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run(self) -> None:
        opts, start = self.opts, self.client.now()
        rng = random.Random(opts.seed + 1)
        events = [(start + at, "kill") for at in _every(opts.kill_every_s, opts.soak_s)]
        events += [(start + at, "stall") for at in _every(opts.stall_every_s, opts.soak_s)]
        at, n = start, 0
        while True:
            at += rng.expovariate(opts.rate)
            if at >= start + opts.soak_s:
                break
            events.append((at, "plain"))
        for at, what in sorted(events):
            await asyncio.sleep(max(0.0, at - self.client.now()))
            n += 1
            self._spawn(self._event(what, n))
        await self._drain()

    async def _event(self, what: str, n: int) -> None:
        if what == "plain":
            await self.client.send(self.prompts.plan(f"{self.opts.mode}-s-{n}", "soak", self.opts.soak_disconnect, 0.2))
        elif what == "stall":
            await self.client.send(Planned(f"stall-{n}", "soak", "stall", self.prompts.prompt(48, 96), 16))
        else:
            kind = ("prefill", "decode")[len(self.kills) % 2]
            self.kills.append(KillEvent(kind, f"kill-{kind}-{n}", None, None, None, None))
            await self._kill(self.kills[-1])

    async def _kill(self, kill: KillEvent) -> None:
        """Send the killing request, wait for the pool's new engine id, then send a probe."""
        pool = "PrefillServer" if kill.kind == "prefill" else "DecodeServer"
        await self.watch.wait_new(pool, set(), timeout_s=120)  # the pool is up (a previous restart done)
        before = self.watch.live(pool)
        kill.old_engine = next(iter(before), None)
        planned = Planned(kill.request_id, "soak", f"kill-{kill.kind}", self.prompts.prompt(48, 96), 32)
        outcome = await self.client.send(planned)
        new = await self.watch.wait_new(pool, before, timeout_s=180)
        last_report = self.watch.last_seen(kill.old_engine) if new else None
        by_client = outcome.last_token_s if kill.kind == "decode" and outcome.result == ERROR_EVENT else None
        kill.crash_s = by_client if by_client is not None else last_report
        if new is not None:
            kill.new_engine, kill.restarted_s = new, self.watch.first_seen(new)
            probe = Planned(f"probe-{kill.request_id}", "soak", "probe", self.prompts.prompt(32, 64), 16)
            await self.client.send(probe)

    async def _drain(self) -> None:
        """Wait for what is in flight (each request is bounded by the read timeout)."""
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=self.client.hang_s + 240)
        for task in list(self.tasks):  # past every bound: counted as hangs by their absence
            task.cancel()


def _every(period_s: float, until_s: float) -> list[float]:
    """``period_s``, 2 x ``period_s``, ... strictly before ``until_s``."""
    return [k * period_s for k in range(1, math.ceil(until_s / period_s))]


async def settle(watch: KVWatch, client: Client, timeout_s: float = TIMEOUT_S + 70) -> Any:
    """The leak check: wait (leases run out in ``TIMEOUT_S``) until the live replicas of both
    pools hold no block; the check as it stood at the deadline otherwise."""
    start = client.now()
    while True:
        check = watch.leak_check()
        if check.held_blocks == 0 and check.ok and sorted(check.live) == sorted(POOLS):
            return replace(check, settled_s=round(client.now() - start, 1))
        if client.now() - start > timeout_s:
            return check
        await asyncio.sleep(1.0)


# ---- GET /admin/kv ---------------------------------------------------------------------------


class KVWatch:
    """Reads ``GET /admin/kv`` every second: the engine ids (a restart is a new one), each
    replica's memory, invariant violations, and the blocks held (the leak check)."""

    def __init__(self, client: Client, warmup_s: float) -> None:
        self.client, self.warmup_s = client, warmup_s
        self.engines: dict[str, EngineMemory] = {}
        self.view: dict[str, Any] = {"ok": True, "replicas": []}
        self.violations: list[dict[str, Any]] = []
        self.failures = 0  # /admin/kv not answering 200
        self.warm_from_s = float("inf")  # memory after warm-up: counted from the soak's start

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(1.0)

    async def poll(self) -> None:
        try:
            response = await self.client.http.get("/admin/kv", timeout=10)
        except httpx.HTTPError:
            self.failures += 1
            return
        if response.status_code != 200:
            self.failures += 1
            return
        self.view = response.json()
        for entry in self.view["replicas"]:
            if entry["live"]:
                self._record(entry)

    def _record(self, entry: dict[str, Any]) -> None:
        at, rss = entry["published_at"] - self.client.wall0, entry.get("rss_bytes")
        engine = self.engines.setdefault(
            entry["engine_id"], EngineMemory(entry["engine_id"], entry["deployment"], at, at)
        )
        engine.last_seen_s, engine.last_rss = max(engine.last_seen_s, at), rss
        if engine.warm_s is None and at >= max(engine.first_seen_s, self.warm_from_s) + self.warmup_s:
            engine.warm_s, engine.warm_rss = at, rss
        problems = list(entry.get("problems") or [])
        seen = {(v["engine_id"], tuple(v["problems"])) for v in self.violations}
        if not entry["ok"] and (entry["engine_id"], tuple(problems)) not in seen:
            row = {"t_s": round(at, 1), "engine_id": entry["engine_id"], "deployment": entry["deployment"]}
            self.violations.append({**row, "problems": problems})

    def live(self, pool: str) -> set[str]:
        return {e["engine_id"] for e in self.view["replicas"] if e["live"] and e["deployment"] == pool}

    def first_seen(self, engine_id: str | None) -> float | None:
        return self.engines[engine_id].first_seen_s if engine_id in self.engines else None

    def last_seen(self, engine_id: str | None) -> float | None:
        return self.engines[engine_id].last_seen_s if engine_id in self.engines else None

    async def wait_new(self, pool: str, before: set[str], timeout_s: float) -> str | None:
        """The id of a live engine of ``pool`` not in ``before`` (the restarted one)."""
        deadline = self.client.now() + timeout_s
        while self.client.now() < deadline:
            new = self.live(pool) - before
            if new:
                return min(new, key=lambda e: self.first_seen(e) or 0.0)
            await asyncio.sleep(0.5)
        return None

    def leak_check(self) -> LeakCheck:
        live = [e for e in self.view["replicas"] if e["live"]]
        held = sum(e["num_in_use_blocks"] for e in live)  # pinned and reserved blocks are in use too
        replicas = [{k: e.get(k) for k in HELD_FIELDS} for e in live]
        return LeakCheck(held, None, bool(self.view["ok"]), sorted({e["deployment"] for e in live}), replicas)

    def mark_end(self) -> None:
        live = {e["engine_id"] for e in self.view["replicas"] if e["live"]}
        for engine in self.engines.values():
            engine.live_at_end = engine.engine_id in live


# ---- the run ---------------------------------------------------------------------------------


def bounds() -> Bounds:
    """A hang: no byte for longer than the service's longest bound (the stream idle timeout,
    the transfer timeout) plus ``SLACK_S``; a long silence: the transfer timeout plus it."""
    return Bounds(hang_s=max(STREAM_IDLE_S, TIMEOUT_S) + SLACK_S, long_s=TIMEOUT_S + SLACK_S)


async def run_phases(url: str, opts: Options, specs: list[FaultSpec]) -> dict[str, Any]:
    """Warm up, the burst and its leak check, the soak and its leak check."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as plain:
        model = (await plain.get("/v1/models")).json()["data"][0]["id"]
    client = Client(url, model, specs, bounds().hang_s)
    prompts, watch = Prompts(opts.seed), KVWatch(client, opts.warmup_s)
    watcher = asyncio.ensure_future(watch.run())
    try:
        for i in range(3):
            await client.send(Planned(f"warmup-{i}", "warmup", "plain", prompts.prompt(32, 64), 8))
        start = client.now()
        await burst(client, prompts, opts)
        burst_s, burst_leak = client.now() - start, await settle(watch, client)
        print(f"burst: {burst_s:.0f} s, leak check {burst_leak}", file=sys.stderr)
        watch.warm_from_s = start = client.now()
        soak = Soak(client, prompts, watch, opts)
        await soak.run()
        soak_s, soak_leak = client.now() - start, await settle(watch, client)
        print(f"soak: {soak_s:.0f} s, leak check {soak_leak}", file=sys.stderr)
        await watch.poll()
        watch.mark_end()
    finally:
        watcher.cancel()
        await client.http.aclose()
    return {
        "outcomes": client.outcomes,
        "durations": (burst_s, soak_s),
        "leaks": (burst_leak, soak_leak),
        "kills": soak.kills,
        "watch": watch,
    }


def summarize(opts: Options, specs: list[FaultSpec], result: dict[str, Any], logs: dict[str, Any]) -> dict[str, Any]:
    import ray

    from bench.host import machine

    outcomes, watch = result["outcomes"], result["watch"]
    phases = {p: [o for o in outcomes if o.phase == p] for p in ("burst", "soak")}
    settings = {k: v for k, v in asdict(opts).items() if k not in ("out", "raw")}
    settings.update(
        kv_transfer_timeout_s=TIMEOUT_S, stream_idle_timeout_s=STREAM_IDLE_S, app_args=app_args(opts.mode, specs)
    )
    return {
        "mode": opts.mode,
        "command": " ".join(["python -m bench.reliability", *sys.argv[1:]]),
        "machine": machine(),
        "ray": ray.__version__,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "settings": settings,
        "faults": [asdict(spec) for spec in specs],
        "burst": phase_summary(phases["burst"], result["leaks"][0], bounds(), specs, result["durations"][0]),
        "soak": phase_summary(phases["soak"], result["leaks"][1], bounds(), specs, result["durations"][1]),
        "kills": [kill_summary(kill, phases["soak"]) for kill in result["kills"]],
        "memory": memory_rows(list(watch.engines.values())),
        "invariant_violations": watch.violations,
        "admin_kv_failures": watch.failures,
        "logs": logs,
    }


# ---- the command line ------------------------------------------------------------------------

QUICK = {"concurrency": 20, "soak_s": 90.0, "kill_every_s": 30.0, "stall_every_s": 40.0, "warmup_s": 20.0}


def parse_args(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(prog="bench.reliability", description=__doc__.split("\n\n")[0])
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
    args = vars(parser.parse_args(argv))
    quick = args.pop("quick")
    if quick:
        args.update({k: v for k, v in QUICK.items() if args[k] == parser.get_default(k)})
    args["out"] = Path(args["out"] or ("/tmp/reliability_quick" if quick else "docs"))
    args["raw"] = Path(args["raw"] or f"/tmp/reliability_raw_{args['mode']}.json")
    return Options(**args)


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    specs = fault_specs(opts.mode)
    keep_logs = Path(f"/tmp/reliability_logs_{opts.mode}")
    server = Server(app_args(opts.mode, specs), keep_logs)
    with server:
        result = asyncio.run(run_phases(server.url, opts, specs))
    summary = summarize(opts, specs, result, scan_logs(keep_logs))
    opts.raw.write_text(json.dumps([asdict(o) for o in result["outcomes"]], indent=0))
    save(opts.out, summary)
    print(f"wrote {opts.out / 'reliability.md'}; logs kept in {keep_logs}", file=sys.stderr)


if __name__ == "__main__":
    main()
