"""bench.reliability's report on hand-made outcomes (no Ray, no server): outcomes by cause, per
fault, each kill's restart and recovery, memory growth, the targets, the rendered page and the
merged JSON; the client's reading of SSE lines; the fault rules it configures (valid, and drawn
per request id as the server draws them); the log scan."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import httpx
import pytest

from app.settings import AppConfig
from bench.reliability import (
    COMPLETED,
    CUT,
    DISCONNECTED,
    ERROR_EVENT,
    HANG,
    SHORT,
    Client,
    EngineMemory,
    KillEvent,
    KVWatch,
    Outcome,
    Planned,
    Prompts,
    _http_result,
    _take,
    app_args,
    cause_counts,
    fault_specs,
    kill_summary,
    memory_rows,
    parse_args,
    phase_summary,
    render,
    save,
    scan_logs,
    soak,
    verdict,
)
from bench.report import block, markers
from kv_transport.faults import FaultPoints

SPECS = [
    dict(name="transfer failure", kind="random", rules=[{"point": "fetch", "action": "fail", "probability": 0.05}],
         effect="raises"),
    dict(name="stalled transfer", kind="stall", rules=[{"point": "fetch", "action": "delay", "seconds": 21.0}],
         effect="outlives"),
    dict(name="decode killed", kind="kill-decode", rules=[{"point": "mid_decode", "action": "crash"}],
         effect="SIGKILL"),
]  # fmt: skip


def _leak(held: int, settled_s: float | None, ok: bool, live: list[str]) -> dict:
    return {"held_blocks": held, "settled_s": settled_s, "ok": ok, "live": live}


def _out(rid: str, sent: float, end: float, result: str = COMPLETED, **fields) -> Outcome:
    base = {"phase": "soak", "kind": "plain", "faults": (), "prompt_tokens": 64, "max_tokens": 16}
    base.update(fields)
    first = sent + 0.5 if result == COMPLETED else None
    return Outcome(rid, sent_s=sent, end_s=end, status=200, result=result, first_token_s=first, **base)


OUTCOMES = [
    _out("s-1", 0.0, 2.0),
    _out("s-2", 1.0, 5.0, faults=("transfer failure",)),  # retried: completes, slower
    _out("s-3", 2.0, 3.0, DISCONNECTED, kind="disconnect", cause="after 3 chunks", num_tokens=3),
    _out("kill-decode-4", 10.0, 11.0, ERROR_EVENT, kind="kill-decode", cause="replica_unavailable", num_tokens=4),
    _out("s-5", 10.5, 11.2, ERROR_EVENT, cause="replica_unavailable", num_tokens=2),  # in flight at the crash
    _out("s-6", 12.0, 40.0, ERROR_EVENT, cause="no replica could take the request within 30 s"),  # before restart
    _out("s-7", 25.0, 26.0),  # sent after the restart (24.0): recovered at 26.0
    _out("stall-8", 30.0, 52.0, kind="stall", max_silence_s=21.5),
    _out("s-9", 31.0, 107.0, HANG, max_silence_s=75.0, cause="no byte within the read timeout"),
]
KILL = KillEvent("decode", "kill-decode-4", "decode-1", "decode-2", crash_s=10.8, restarted_s=24.0)


def _summary(mode: str = "pull") -> dict:
    leak = _leak(0, 21.0, True, ["DecodeServer", "PrefillServer"])
    engines = [
        EngineMemory("prefill-1", "PrefillServer", 0.0, 300.0, 60.0, 1000 << 20, 1050 << 20, True),
        EngineMemory("decode-1", "DecodeServer", 0.0, 10.8, None, None, 900 << 20, False),
        EngineMemory("decode-2", "DecodeServer", 24.0, 300.0, 84.0, 800 << 20, 960 << 20, True),
    ]
    burst = [_out("b-1", 0.0, 3.0, phase="burst"), _out("b-2", 0.0, 1.0, DISCONNECTED, kind="disconnect")]
    return {
        "mode": mode,
        "command": f"python -m bench.reliability --mode {mode}",
        "machine": "2 cores, 23 GiB, Python 3.11.7, torch 2.13.0+cpu, no GPU",
        "ray": "2.60.0",
        "date": "2026-12-01 00:00 UTC",
        "settings": {
            "concurrency": 2,
            "burst_disconnect": 0.5,
            "soak_s": 120.0,
            "rate": 1.0,
            "soak_disconnect": 0.1,
            "kill_every_s": 60.0,
            "stall_every_s": 30.0,
            "kv_transfer_timeout_s": 20.0,
        },  # fmt: skip
        "faults": SPECS,
        "burst": phase_summary(burst, leak, SPECS, 3.0),
        "soak": phase_summary(OUTCOMES, leak, SPECS, 120.0),
        "kills": [kill_summary(KILL, OUTCOMES)],
        "memory": memory_rows(engines),
        "invariant_violations": [],
        "logs": {"dir": "/tmp/x", "expected": {"replica: crash injected": 1}, "unexpected_count": 0, "unexpected": []},
    }


def test_outcomes_by_result_and_cause():
    soak = phase_summary(OUTCOMES, None, SPECS, 120.0)
    assert soak["results"] == {COMPLETED: 4, DISCONNECTED: 1, ERROR_EVENT: 3, HANG: 1}
    assert soak["hangs"] == 1 and soak["long_silences"] == 1  # the hang; the stall (21.5 s) is under 35 s
    assert [a["request_id"] for a in soak["anomalies"]] == ["s-9"]
    rows = cause_counts(OUTCOMES)
    assert rows[1:3] == [
        {"result": ERROR_EVENT, "cause": "replica_unavailable", "when": "after tokens", "count": 2},
        {"result": ERROR_EVENT, "cause": "no replica could take the request within 30 s", "when": "before a token",
         "count": 1},
    ]  # fmt: skip
    assert soak["faults"] == [
        {"fault": "transfer failure", "requests": 1, "results": {COMPLETED: 1}, "median_e2e_s": 4.0,
         "plain_median_e2e_s": 1.5},
    ]  # fmt: skip
    assert soak["kinds"] == [
        {"kind": "disconnect", "requests": 1, "results": {DISCONNECTED: 1}, "median_e2e_s": None},
        {"kind": "stall", "requests": 1, "results": {COMPLETED: 1}, "median_e2e_s": 22.0},
    ]


def test_kill_restart_and_recovery():
    row = kill_summary(KILL, OUTCOMES)
    assert row["client_saw"] == {"result": ERROR_EVENT, "cause": "replica_unavailable", "tokens": 4}
    # in flight at the crash (s-5) or sent before the restart (s-6, and s-1..s-3 ended before the crash)
    assert row["affected"] == {ERROR_EVENT: 2}
    assert row["restart_s"] == pytest.approx(13.2)
    assert row["recover_s"] == pytest.approx(15.2)  # s-7 ended at 26.0
    assert row["first_ok_after_crash_s"] == pytest.approx(15.2)
    never = kill_summary(KillEvent("prefill", "kill-prefill-1", "p-1", None, 10.8, None), OUTCOMES)
    assert never["restart_s"] is None and never["recover_s"] is None and never["client_saw"] is None


def test_memory_growth_only_over_a_minute():
    rows = memory_rows(
        [
            EngineMemory("e-1", "DecodeServer", 0.0, 200.0, 60.0, 100, 105),
            EngineMemory("e-2", "DecodeServer", 0.0, 100.0, 60.0, 100, 300),  # 40 s window: not judged
        ]
    )
    assert [r["growth"] for r in rows] == [0.05, None]


def test_verdict_names_what_missed_its_target():
    checks = {v["check"]: (v["measured"], v["met"]) for v in verdict(_summary())}
    assert checks["blocks leaked (each phase, after the leases)"] == ("0/0", True)
    assert checks["hangs"] == ("1", False)
    assert checks["memory growth of the replicas, after warm-up to end"] == ("max +20.0%", False)
    assert checks["every kill recovered (a request on the restarted replica completed)"] == ("1 of 1", True)


def test_render_and_merge(tmp_path):
    save(tmp_path, _summary("push"))
    page = tmp_path / "reliability.md"
    assert "## Reading the results" in page.read_text()
    begin, end = markers("bench.reliability")
    page.write_text(page.read_text().split(end)[0] + end + "\n\n## Findings\n\nWritten by hand.\n")
    merged = save(tmp_path, _summary("pull"))
    assert sorted(merged) == ["pull", "push"]
    assert json.loads((tmp_path / "benchmarks" / "reliability.json").read_text())["push"]["mode"] == "push"
    text = page.read_text()
    assert text.endswith(end + "\n\n## Findings\n\nWritten by hand.\n")  # kept across runs
    assert block(text, "bench.reliability") == "\n".join([begin, *render(merged), end])
    assert text.index("## pull mode") < text.index("## push mode")
    assert "Command: `python -m bench.reliability --mode pull`" in text
    assert "| hangs | 0 | 1 | **NO** |" in text
    assert "| transfer failure: raises | `point=fetch, action=fail, probability=0.05` | 1 | completed 1 |" in text
    assert "restart 13.2 s, recovered 15.2 s" in text
    assert "| PrefillServer | `prefill-1` | 0 s | live at the end | 1000 | 1050 | +5.0% |" in text
    assert "| DecodeServer | `decode-1` | 0 s | gone at 11 s (killed) | - | 900 | not judged (< 60 s) |" in text
    assert "| error_event | `replica_unavailable` | after tokens | 2 |" in text
    assert "| `s-9` | hang | no byte within the read timeout | 31.0 s | 107.0 s | 0 |" in text


def test_a_leak_misses_its_target_and_shows_in_the_phase_and_the_fault_rows():
    summary = _summary()
    summary["burst"]["leak"] = _leak(14, None, False, ["PrefillServer"])
    text = "\n".join(render({"pull": summary}))
    assert "| blocks leaked (each phase, after the leases) | 0 | 14/0 | **NO** |" in text
    assert (
        "After the phase: 14 blocks held on the live replicas (never), invariants VIOLATED, live: PrefillServer."
        in text
    )
    assert "| stalled transfer: outlives | `point=fetch, action=delay, seconds=21.0` | 1 | completed 1 | " in text
    assert "in the request; median E2E 22.0 s | 14 (burst), 0 (soak) |" in text


def test_client_reads_the_stream():
    planned = Planned("r", "soak", "plain", [1, 2], max_tokens=2)
    out = _out("r", 0.0, 0.0, CUT, num_tokens=0)
    usage: list[int] = []
    chunk = 'data: {"choices": [{"text": "a"}]}'
    assert not _take(out, chunk, planned, usage, 1.0) and not _take(out, chunk, planned, usage, 2.0)
    assert not _take(out, 'data: {"choices": [], "usage": {"completion_tokens": 2}}', planned, usage, 2.1)
    assert _take(out, "data: [DONE]", planned, usage, 2.2)
    assert (out.result, out.num_tokens, out.first_token_s, out.last_token_s) == (COMPLETED, 2, 1.0, 2.0)

    short = _out("r", 0.0, 0.0, CUT, num_tokens=0)
    assert not _take(short, 'data: {"choices": [], "usage": {"completion_tokens": 1}}', planned, [], 1.0)
    assert _take(short, "data: [DONE]", planned, [1], 1.0) and (short.result, short.cause) == (SHORT, "1 of 2 tokens")

    failed = _out("r", 0.0, 0.0, CUT, num_tokens=1)
    error = 'data: {"error": {"message": "the decode replica is gone", "code": "replica_unavailable"}}'
    assert not _take(failed, error, planned, [], 1.0)
    assert _take(failed, "data: [DONE]", planned, [], 1.0) and failed.result == ERROR_EVENT
    assert failed.cause == "replica_unavailable"

    cut = Planned("r", "soak", "disconnect", [1], max_tokens=8, cut_after_chunks=1)
    gone = _out("r", 0.0, 0.0, CUT, num_tokens=0)
    assert _take(gone, chunk, cut, [], 1.0) and (gone.result, gone.cause) == (DISCONNECTED, "after 1 chunks")

    body = b'{"error": {"message": "server busy", "type": "server_error"}}'
    assert _http_result(503, body, httpx.Headers({"Retry-After": "1"})) == ("http_503", "server busy (Retry-After: 1)")
    assert _http_result(500, b"oops", httpx.Headers()) == ("http_5xx", "oops")


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_fault_rules_are_valid_and_drawn_as_the_server_draws(mode):
    specs = fault_specs(mode)
    config = AppConfig.model_validate({"faults": json.loads(app_args(mode, specs)["faults"])})
    assert len(config.faults) == sum(len(s["rules"]) for s in specs)
    points = FaultPoints(config.faults)
    ids = [f"{mode}-s-{i}" for i in range(2000)]
    failing = [rid for rid in ids if any(r.action == "fail" for _, r in points.selected(config.faults[0].point, rid))]
    assert 50 <= len(failing) <= 150  # 5% of 2,000
    assert {s["kind"] for s in specs} >= {"random", "stall", "kill-prefill", "kill-decode"}


def test_quick_options():
    opts = parse_args(["--quick", "--mode", "push"])
    assert (opts.mode, opts.concurrency, opts.soak_s, str(opts.out)) == ("push", 20, 90.0, "/tmp/reliability_quick")
    assert parse_args(["--quick", "--concurrency", "5"]).concurrency == 5
    assert parse_args(["--quick", "--concurrency", "200"]).concurrency == 200  # given, if the default: kept


def test_log_scan(tmp_path):
    serve = tmp_path / "serve"
    serve.mkdir()
    crash = "ERROR 2026-12-01 00:40:01,000 app_DecodeServer abc kill-decode-3 -- fault injection: crashing here"
    (serve / "replica_app_DecodeServer_abc.log").write_text(
        crash + "\n"
        "WARNING 2026-12-01 00:40:02,000 app_OpenAIIngress xyz s-1 -- request s-1: KV transfer failed; retrying\n"
        "WARNING 2026-12-01 00:40:03,000 app_OpenAIIngress xyz s-2 -- something else\n"
        "ERROR 2026-12-01 00:40:04,000 app_OpenAIIngress xyz s-3 -- request failed\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n'
        "ValueError: boom\n"
    )
    (serve / "controller_77.log").write_text('Traceback (most recent call last):\n  File "c"\nActorDiedError: x\n')
    worker = crash + "\nKV of request s-9 unclaimed after 20.0 s: freeing its blocks\n"
    (tmp_path / "worker-aa-01-55.err").write_text(
        worker + "Traceback (most recent call last):\n  File \"y\"\nKeyError: 'k'\n"
    )
    (tmp_path / "worker-bb-ff-77.err").write_text('Traceback (most recent call last):\n  File "c"\nActorDiedError: x\n')
    logs = scan_logs(tmp_path)
    assert logs["expected"] == {  # the crash line is in both files: once
        "ingress: retried before the first token": 1,
        "replica: crash injected": 1,
        "replica: exported KV unclaimed, freed at the lease's end": 1,
    }
    assert {row["line"]: row["count"] for row in logs["unexpected"]} == {
        "app_OpenAIIngress: request failed": 1,
        "app_OpenAIIngress: traceback: ValueError: boom": 1,
        "app_DecodeServer: traceback: KeyError: 'k'": 1,
    }
    # Serve's controller: apart, and not again from its worker-*.err
    assert logs["serve_internal"] == [{"line": "controller: traceback: ActorDiedError: x", "count": 1}]
    assert logs["other_warnings"] == [{"line": "app_OpenAIIngress: something else", "count": 1}]


def test_the_client_draws_the_random_faults_as_the_server_does():
    specs = fault_specs("pull")
    client = Client("http://127.0.0.1:1", "m", specs)
    rules = AppConfig.model_validate({"faults": json.loads(app_args("pull", specs)["faults"])}).faults
    points = FaultPoints(rules)
    for rid in (f"pull-s-{i}" for i in range(300)):
        failing = any(rules[i].action == "fail" for i, _ in points.selected("fetch", rid))
        assert ("transfer failure" in client.drawn(rid)) == failing
    assert client.drawn("stall-1") == ()  # prefixed rules are not random
    asyncio.run(client.http.aclose())


def test_prompts_plan_lengths_by_phase():
    prompts = Prompts(seed=3)
    burst = [prompts.plan(f"b-{i}", "burst", disconnect=0.5) for i in range(40)]
    assert all(16 <= len(p.prompt) <= 64 and 8 <= p.max_tokens <= 40 for p in burst)
    assert {p.kind for p in burst} == {"plain", "disconnect"}
    cut = [p for p in burst if p.kind == "disconnect"]
    assert all((p.cut_after_chunks is None) != (p.cut_after_s is None) for p in cut)
    soak = [prompts.plan(f"s-{i}", "soak", disconnect=0.0, long_share=1.0) for i in range(5)]
    assert all(300 <= len(p.prompt) <= 440 and p.kind == "plain" for p in soak)


class _Clock:
    def __init__(self) -> None:
        self.t0, self.wall0, self.sent = time.monotonic(), time.time(), []

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def send(self, planned: Planned) -> Outcome:
        self.sent.append(planned)
        result = ERROR_EVENT if planned.kind == "kill-decode" else COMPLETED
        now = self.now()
        return _out(planned.request_id, now, now, result, kind=planned.kind, num_tokens=4, last_token_s=now)


class _Pools:
    """/admin/kv as a kill sees it: one engine per pool, a new one once its kill was sent."""

    def __init__(self, client: _Clock) -> None:
        self.client, self.restarted = client, set()

    def live(self, pool: str) -> set[str]:
        killed = any(p.kind.startswith("kill-") and pool.lower().startswith(p.kind[5:]) for p in self.client.sent)
        return {f"{pool}-{'new' if killed else 'old'}"}

    async def wait_new(self, pool: str, before: set[str], timeout_s: float) -> str | None:
        return next(iter(self.live(pool) - before), None)

    def seen(self, engine_id: str | None, when: str) -> float | None:
        return {"first_seen_s": 5.0, "last_seen_s": 1.0}[when]


def test_soak_sends_its_traffic_stalls_and_kills_in_turn():
    client = _Clock()
    opts = parse_args(["--soak-s", "0.6", "--rate", "20", "--kill-every-s", "0.2", "--stall-every-s", "0.5"])
    kills = asyncio.run(soak(client, Prompts(seed=0), _Pools(client), opts))
    # kills at 0.2 and 0.4 s (not at 0.6: only strictly before the soak's end), a stall at 0.5 s
    assert [(k.kind, k.old_engine, k.new_engine) for k in kills] == [
        ("prefill", "PrefillServer-old", "PrefillServer-new"),
        ("decode", "DecodeServer-old", "DecodeServer-new"),
    ]
    assert kills[0].crash_s == 1.0 and kills[0].restarted_s == 5.0  # the dead replica's last report
    assert kills[1].crash_s is not None and kills[1].crash_s != 1.0  # the kill request's last token
    kinds = Counter(p.kind for p in client.sent)
    assert kinds["stall"] == 1 and kinds["probe"] == 2 and kinds["kill-prefill"] == kinds["kill-decode"] == 1
    assert kinds["plain"] + kinds["disconnect"] > 3


def test_kv_watch_records_memory_violations_and_leaks():
    client = _Clock()
    watch = KVWatch(client, warmup_s=10.0)
    watch.warm_from_s = 0.0
    entry = {"deployment": "DecodeServer", "engine_id": "d-1", "live": True, "ok": True, "num_in_use_blocks": 3}
    for at, rss in ((0.0, 100), (12.0, 110), (80.0, 121)):
        watch._record(entry | {"published_at": client.wall0 + at, "rss_bytes": rss})
    broken = entry | {"published_at": client.wall0 + 81, "rss_bytes": 121, "ok": False, "problems": ["free list"]}
    watch._record(broken)
    watch._record(broken)  # the same problem twice: one violation
    engine = watch.engines["d-1"]
    assert (engine.warm_s, engine.warm_rss, engine.last_rss) == (12.0, 110, 121) and engine.growth == pytest.approx(0.1)
    assert watch.violations == [
        {"t_s": 81.0, "engine_id": "d-1", "deployment": "DecodeServer", "problems": ["free list"]}
    ]
    watch.view = {"ok": True, "replicas": [entry, entry | {"deployment": "PrefillServer", "live": False}]}
    assert watch.leak_check() == _leak(3, None, True, ["DecodeServer"])
    assert watch.live("DecodeServer") == {"d-1"} and watch.seen("d-1", "first_seen_s") == 0.0
