"""``bench.reliability``'s report: what the client saw of each request, the figures computed
from it (outcomes by cause, per fault, each kill's restart and recovery, each replica's
memory) and ``docs/reliability.md`` rendered from the summary.

Nothing here needs Ray or a server (files only: the logs read, the report written), so the
report can be re-rendered from ``docs/benchmarks/reliability.json`` alone and is tested on a
frozen summary (tests/bench/test_reliability_report.py). Times are seconds on the run's
clock (0: the client started, once the application answered ``/ready``).
"""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# what the client saw of one request (``Outcome.result``)
COMPLETED = "completed"  # 200, every token asked for, [DONE]
DISCONNECTED = "disconnected"  # the client closed the stream on purpose
ERROR_EVENT = "error_event"  # 200, then data: {"error": ...} and [DONE]
HTTP_503, HTTP_504, HTTP_4XX, HTTP_5XX = "http_503", "http_504", "http_4xx", "http_5xx"
SHORT = "short"  # 200 and [DONE] without an error, but fewer tokens than asked: a silent cut
CUT = "cut"  # the stream ended without [DONE]: a silent cut
HANG = "hang"  # no byte for longer than the hang bound (the client's read timeout)
CLIENT_ERROR = "client_error"  # connection refused, reset, ...
ANOMALIES = (HTTP_5XX, SHORT, CUT, HANG, CLIENT_ERROR)
RESULT_ORDER = (COMPLETED, DISCONNECTED, ERROR_EVENT, HTTP_503, HTTP_504, HTTP_4XX, *ANOMALIES)
MEMORY_GROWTH_LIMIT = 0.10
MIN_MEMORY_WINDOW_S = 60.0  # a replica's growth is judged over at least this long


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

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.sent_s


@dataclass
class KillEvent:
    """One replica killed by a prefixed request (``kind``: prefill or decode)."""

    kind: str
    request_id: str
    old_engine: str | None
    new_engine: str | None
    crash_s: float | None  # decode: the kill request's last token; prefill: the dead replica's last report
    restarted_s: float | None  # the new engine id first seen live in /admin/kv


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
        return self.last_rss / self.warm_rss - 1


@dataclass
class LeakCheck:
    """Blocks still held (in use, which counts the pinned and reserved ones) on the live replicas once traffic
    stopped and the KV leases ran out; ``settled_s`` how long that took (None: never)."""

    held_blocks: int
    settled_s: float | None
    ok: bool  # every live replica's invariants held
    live: list[str] = field(default_factory=list)  # deployments live at the end
    replicas: list[dict[str, Any]] = field(default_factory=list)  # each live replica's accounting (HELD_FIELDS)


HELD_FIELDS = (  # of a replica's /admin/kv entry, kept with a leak check
    "deployment", "engine_id", "num_total_blocks", "num_free_blocks", "num_cached_blocks", "num_in_use_blocks",
    "num_pinned_blocks", "num_reserved_blocks", "num_requests", "num_pinned_requests", "num_reserved_requests",
    "oldest_pinned_s", "oldest_reserved_s", "problems",
)  # fmt: skip


@dataclass
class FaultSpec:
    """A named fault of the run: its rules (``faults:`` entries) and how requests meet it."""

    name: str
    kind: str  # random (drawn per request id) or the request kind that triggers it (stall, kill-prefill, ...)
    rules: list[dict[str, Any]]
    effect: str  # what it does, in words


# ---- figures ---------------------------------------------------------------------------------


def result_counts(outcomes: list[Outcome]) -> dict[str, int]:
    counts = Counter(o.result for o in outcomes)
    return {r: counts[r] for r in RESULT_ORDER if counts[r]}


def cause_counts(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """Rows (result, cause, before/after the first token, count) of the requests not completed."""
    counts = Counter(
        (o.result, o.cause or "", "after tokens" if o.num_tokens else "before a token")
        for o in outcomes
        if o.result != COMPLETED
    )
    rows = [{"result": r, "cause": c, "when": w, "count": n} for (r, c, w), n in counts.items()]
    return sorted(rows, key=lambda row: (RESULT_ORDER.index(row["result"]), -row["count"]))


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


@dataclass(frozen=True)
class Bounds:
    """The client's bounds: a hang is no byte for ``hang_s``; a long silence, ``long_s``."""

    hang_s: float
    long_s: float


def phase_summary(
    outcomes: list[Outcome], leak: LeakCheck | None, bounds: Bounds, faults: list[FaultSpec], duration_s: float
) -> dict[str, Any]:
    """One phase: counts by result and cause, per fault and per planned kind, latencies, hangs
    and long silences, the leak check."""
    done = [o for o in outcomes if o.result == COMPLETED]
    e2e = [o.e2e_s for o in done]
    return {
        "requests": len(outcomes),
        "duration_s": round(duration_s, 1),
        "results": result_counts(outcomes),
        "causes": cause_counts(outcomes),
        "faults": fault_rows(outcomes, faults),
        "kinds": kind_rows(outcomes),
        "median_e2e_s": _median(e2e),
        "p90_e2e_s": round(statistics.quantiles(e2e, n=10)[-1], 3) if len(e2e) > 1 else None,
        "median_ttft_s": _median([o.first_token_s - o.sent_s for o in done if o.first_token_s is not None]),
        "hangs": sum(o.result == HANG for o in outcomes),
        "hang_bound_s": bounds.hang_s,
        "long_silences": sum(o.max_silence_s > bounds.long_s for o in outcomes),
        "long_silence_s": bounds.long_s,
        "max_silence_s": round(max((o.max_silence_s for o in outcomes), default=0.0), 3),
        "anomalies": [asdict(o) for o in outcomes if o.result in ANOMALIES],
        "leak": None if leak is None else asdict(leak),
    }


def fault_rows(outcomes: list[Outcome], faults: list[FaultSpec]) -> list[dict[str, Any]]:
    """Per probabilistic fault: the requests that met it (not disconnected by design) and what
    they saw, with their median E2E beside that of the requests that met no fault."""
    plain = [o.e2e_s for o in outcomes if not o.faults and o.kind == "plain" and o.result == COMPLETED]
    rows = []
    for spec in faults:
        if spec.kind != "random":
            continue
        met = [o for o in outcomes if spec.name in o.faults and o.kind != "disconnect"]
        rows.append(
            {
                "fault": spec.name,
                "requests": len(met),
                "results": result_counts(met),
                "median_e2e_s": _median([o.e2e_s for o in met if o.result == COMPLETED]),
                "plain_median_e2e_s": _median(plain),
            }
        )
    return rows


def kind_rows(outcomes: list[Outcome], kinds: tuple[str, ...] = ("disconnect", "stall")) -> list[dict[str, Any]]:
    """The requests of each planned kind (by design: a disconnect, a stall past the lease)."""
    rows = []
    for kind in kinds:
        mine = [o for o in outcomes if o.kind == kind]
        if mine:
            done = [o.e2e_s for o in mine if o.result == COMPLETED]
            rows.append(
                {"kind": kind, "requests": len(mine), "results": result_counts(mine), "median_e2e_s": _median(done)}
            )
    return rows


def kill_summary(kill: KillEvent, outcomes: list[Outcome]) -> dict[str, Any]:
    """One kill: what its own request saw; what the requests in flight at the crash or sent
    before the restart saw; restart time; recovery: the first request sent after the restart
    (so served by the restarted replica: one per pool) that completed."""
    own = next((o for o in outcomes if o.request_id == kill.request_id), None)
    row: dict[str, Any] = {**asdict(kill), "client_saw": None, "affected": {}, "restart_s": None, "recover_s": None}
    if own is not None:
        row["client_saw"] = {"result": own.result, "cause": own.cause, "tokens": own.num_tokens}
    if kill.crash_s is None:
        return row
    until = kill.restarted_s if kill.restarted_s is not None else float("inf")
    affected = [
        o
        for o in outcomes
        if o.request_id != kill.request_id and o.sent_s < until and (o.end_s is None or o.end_s >= kill.crash_s)
    ]
    row["affected"] = result_counts(affected)
    served = [o.end_s for o in outcomes if o.sent_s >= kill.crash_s and o.result == COMPLETED]
    row["first_ok_after_crash_s"] = round(min(served) - kill.crash_s, 3) if served else None
    if kill.restarted_s is not None:
        row["restart_s"] = round(kill.restarted_s - kill.crash_s, 3)
        recovered = [o.end_s for o in outcomes if o.sent_s >= kill.restarted_s and o.result == COMPLETED]
        row["recover_s"] = round(min(recovered) - kill.crash_s, 3) if recovered else None
    return row


def memory_rows(engines: list[EngineMemory]) -> list[dict[str, Any]]:
    rows = []
    for engine in sorted(engines, key=lambda e: (e.deployment, e.first_seen_s)):
        growth = engine.growth
        rows.append({**asdict(engine), "growth": None if growth is None else round(growth, 4)})
    return rows


def verdict(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets against what was measured: (check, target, measured, met)."""
    phases = [summary[p] for p in ("burst", "soak") if summary.get(p)]
    leaks = [p["leak"]["held_blocks"] if p["leak"] else None for p in phases]
    growths = [m["growth"] for m in summary["memory"] if m["growth"] is not None]
    anomalies = sum(len(p["anomalies"]) for p in phases)
    hangs = sum(p["hangs"] for p in phases)
    violations = len(summary.get("invariant_violations", []))
    max_growth = max(growths, default=None)
    recovered = [k["recover_s"] for k in summary["kills"]]
    rows = [
        ("blocks leaked (each phase, after the leases)", "0", "/".join(map(str, leaks)), all(x == 0 for x in leaks)),
        ("invariant violations seen in /admin/kv", "0", str(violations), violations == 0),
        ("hangs", "0", str(hangs), hangs == 0),
        ("silent cuts, short streams, 500s, client errors", "0", str(anomalies), anomalies == 0),
        (
            "memory growth of the replicas, after warm-up to end",
            f"<= {MEMORY_GROWTH_LIMIT:.0%}",
            "n/a" if max_growth is None else f"max {max_growth:+.1%}",
            max_growth is not None and max_growth <= MEMORY_GROWTH_LIMIT,
        ),
        (
            "every kill recovered (a request on the restarted replica completed)",
            "all",
            f"{sum(r is not None for r in recovered)} of {len(recovered)}",
            all(r is not None for r in recovered),
        ),
    ]
    return [{"check": c, "target": t, "measured": m, "met": ok} for c, t, m, ok in rows]


# ---- the logs --------------------------------------------------------------------------------

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
HEX_ID = re.compile(r"[0-9a-f]{16,}")
NUMBER = re.compile(r"\d+(\.\d+)?")
SERVE_LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d{4}-\d\d-\d\d [\d:,]+ (\S+) ")
MAX_EXAMPLES = 30


def scan_logs(log_dir: Path) -> dict[str, Any]:
    """The Ray session's logs after the run (``serve/*.log`` and the workers' ``*.err``, where
    the engine replicas' lines land; a line in both is counted once): the expected one-line
    events counted; every traceback, ``ERROR`` line not expected, and ``WARNING`` line not
    expected, counted by text and prefixed with the process's Serve component."""
    counts: dict[str, Counter] = {k: Counter() for k in ("expected", "unexpected", "serve", "warnings")}
    controllers = {p.stem.split("_")[-1] for p in (log_dir / "serve").glob("controller_*.log")}
    paths = sorted((log_dir / "serve").glob("*.log")) + [
        p for p in sorted(log_dir.glob("worker-*.err")) if p.stem.split("-")[-1] not in controllers
    ]
    seen: set[str] = set()
    for path in paths:
        lines = path.read_text(errors="replace").splitlines()
        _classify(lines, seen, counts)
        components = Counter(m.group(2) for m in map(SERVE_LINE.match, lines) if m)
        prefix = path.stem.split("_")[0]
        source = components.most_common(1)[0][0] if components else prefix if prefix in SERVE_COMPONENTS else path.name
        counts["serve" if source in SERVE_COMPONENTS else "unexpected"].update(_tracebacks(source, lines))
    expected = counts["expected"]
    summary: dict[str, Any] = {
        "dir": str(log_dir),
        "expected": {name: expected[name] for name in EXPECTED_LOG if expected[name]},
    }
    for key, name in (("unexpected", "unexpected"), ("serve", "serve_internal"), ("warnings", "other_warnings")):
        summary[f"{name}_count"] = sum(counts[key].values())
        summary[name] = [{"line": k, "count": v} for k, v in counts[key].most_common(MAX_EXAMPLES)]
    return summary


def _classify(lines: list[str], seen: set[str], counts: dict[str, Counter]) -> None:
    for line in lines:
        match = SERVE_LINE.match(line)
        if match:
            if line in seen:
                continue
            seen.add(line)
        names = [name for name, text in EXPECTED_LOG.items() if text in line][:1]
        counts["expected"].update(names)
        if names or not match:
            continue
        message = f"{match.group(2)}: {HEX_ID.sub('<id>', line.split(' -- ', 1)[-1][:200])}"
        if match.group(1) == "WARNING":  # grouped by shape: numbers (ids, times) left out
            counts["serve" if match.group(2) in SERVE_COMPONENTS else "warnings"][NUMBER.sub("N", message)] += 1
        elif match.group(1) in ("ERROR", "CRITICAL"):
            counts["serve" if match.group(2) in SERVE_COMPONENTS else "unexpected"][message] += 1


def _tracebacks(source: str, lines: list[str]) -> list[str]:
    """Each traceback in ``lines`` as its exception line (the first unindented line after it)."""
    found = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            tail = next((t for t in lines[i + 1 :] if t and not t[0].isspace()), "(end of file)")
            found.append(f"{source}: traceback: {HEX_ID.sub('<id>', tail[:200])}")
    return found


# ---- files -----------------------------------------------------------------------------------


def save(out: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """Merge this mode's summary into ``out/benchmarks/reliability.json`` (other modes kept)
    and render ``out/reliability.md`` from all of them; returns the merged summaries."""
    path = out / "benchmarks" / "reliability.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged[summary["mode"]] = summary
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    page = out / "reliability.md"
    page.write_text(render(merged, page.read_text() if page.exists() else ""))
    return merged


# ---- docs/reliability.md ---------------------------------------------------------------------

TITLE = "# Reliability: load and soak with faults, through the HTTP API\n"
BEGIN, END = "<!-- generated by bench.reliability: begin -->", "<!-- generated by bench.reliability: end -->"
FINDINGS = """## Findings

(Hand-written; `python -m bench.reliability` regenerates only the block above and keeps this.)
"""
LIMITS = """## What this shows, and its limits

- Every failure here is injected by the application's own `faults:` configuration
  (`kv_transport/faults.py`): a crash is the replica's process sending itself `SIGKILL` at a
  named point, so it lands exactly where asked (mid-transfer, mid-stream), which a `kill -9`
  from outside could not aim at. Probabilistic faults are drawn once per request id (a seeded
  hash), so the script knows which requests met which fault and tabulates them.
- One machine, loopback only, 2 CPU cores shared by the client, Serve's proxy and both
  replicas; the rates are modest on purpose (the point is failures, not throughput, see
  `docs/benchmarks/goodput.md`). One prefill and one decode replica: a dead decode replica has no
  peer to take its streams, so those end with an error event, and requests without a token
  wait for the restart (`recovery.wait_s`).
- A hang is a request that got no byte for longer than the service's own longest bound
  (`limits.stream_idle_timeout_s`, and `kv_transfer_timeout_s` for transfers) plus 15 s: the
  client's read timeout. Requests silent for more than `kv_transfer_timeout_s` + 15 s, but
  ended by the service within its bounds, are counted apart ("long silences").
- Leaks are read from `GET /admin/kv` once traffic stopped and every KV lease ran out;
  invariant violations are sampled every second during the whole run.
- Memory is each replica's resident set (`rss_bytes` in `/admin/kv`), first after the replica
  was up for the warm-up, then last seen; a restarted replica is a new process, judged from its
  own warm-up on, and a window shorter than a minute is not judged.
"""


def _counts(results: dict[str, int]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in results.items()) or "-"


def _s(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f} s"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


RULE_ORDER = ("point", "action", "probability", "seconds", "request_id_prefix")


def _rules(spec: dict[str, Any]) -> str:
    parts = []
    for rule in spec["rules"]:
        keys = sorted(rule, key=lambda k: (RULE_ORDER.index(k) if k in RULE_ORDER else len(RULE_ORDER), k))
        text = ", ".join(f"{k}={rule[k]}" for k in keys if rule[k] is not None)
        parts.append(f"`{text}`")
    return "<br>".join(parts) or "-"


def _leaks(summary: dict[str, Any], phases: tuple[str, ...]) -> str:
    held = [f"{summary[p]['leak']['held_blocks']} ({p})" for p in phases if summary.get(p) and summary[p]["leak"]]
    return ", ".join(held) or "-"


def _span(values: list[float | None]) -> str:
    known = sorted(v for v in values if v is not None)
    if not known:
        return "-"
    return f"{known[0]:.1f} s" if len(known) == 1 else f"{known[0]:.1f}-{known[-1]:.1f} s"


def _fault_line(summary: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    """One row of the per-fault table: fault, rules, how many met it, what the client saw,
    time to recover, blocks leaked after."""
    label = f"{spec['name']}: {spec['effect']}"
    if spec["kind"].startswith("kill-"):
        return [label, _rules(spec), *_kill_cells(summary, spec["kind"].removeprefix("kill-"))]
    key, field_ = ("faults", "fault") if spec["kind"] == "random" else ("kinds", "kind")
    name = spec["name"] if spec["kind"] == "random" else spec["kind"]
    found = [(p, r) for p in ("burst", "soak") for r in summary[p][key] if r[field_] == name]
    phases, rows = [p for p, _ in found], [r for _, r in found]
    results: Counter = Counter()
    for row in rows:
        results.update(row["results"])
    e2e = [r["median_e2e_s"] for r in rows]
    if spec["kind"] == "disconnect":
        recover = "-"
    elif spec["kind"] == "random":
        medians = [
            f"{p} {_s(r['median_e2e_s'])} (no fault {_s(r['plain_median_e2e_s'])})" for p, r in zip(phases, rows)
        ]
        recover = "in the request; median E2E " + ", ".join(medians)
    else:
        recover = f"in the request; median E2E {_span(e2e)}"
    met = str(sum(r["requests"] for r in rows))
    return [label, _rules(spec), met, _counts(dict(results)), recover, _leaks(summary, ("burst", "soak"))]


def _kill_cells(summary: dict[str, Any], kind: str) -> list[str]:
    kills = [k for k in summary["kills"] if k["kind"] == kind]
    own: Counter = Counter()
    affected: Counter = Counter()
    for kill in kills:
        saw = kill["client_saw"] or {}
        own[f"{saw.get('result')} ({saw.get('cause') or 'ok'})"] += 1
        affected.update(kill["affected"])
    seen = f"its request: {', '.join(f'{k} x{v}' for k, v in own.items())}; others: {_counts(dict(affected))}"
    restart, recover = _span([k["restart_s"] for k in kills]), _span([k["recover_s"] for k in kills])
    return [f"{len(kills)} kills", seen, f"restart {restart}, recovered {recover}", _leaks(summary, ("soak",))]


def _phase_lines(name: str, phase: dict[str, Any]) -> list[str]:
    lines = [
        f"**{name}**: {phase['requests']} requests in {phase['duration_s']:.0f} s; "
        f"completed: median E2E {_s(phase['median_e2e_s'], 2)}, p90 {_s(phase['p90_e2e_s'], 2)}, "
        f"median TTFT {_s(phase['median_ttft_s'], 2)}; hangs (no byte for > {phase['hang_bound_s']:g} s): "
        f"{phase['hangs']}; long silences (> {phase['long_silence_s']:g} s): {phase['long_silences']}; "
        f"longest silence {_s(phase['max_silence_s'])}.",
        "",
    ]
    rows = [[COMPLETED, "", "", str(phase["results"].get(COMPLETED, 0))]]
    rows += [
        [c["result"], f"`{c['cause']}`" if c["cause"] else "", c["when"], str(c["count"])] for c in phase["causes"]
    ]
    lines += _table(["outcome", "cause", "when", "requests"], rows)
    leak = phase["leak"]
    if leak:
        settled = "never" if leak["settled_s"] is None else f"after {leak['settled_s']:.0f} s"
        lines += [
            "",
            f"After the phase: {leak['held_blocks']} blocks held on the live replicas ({settled}), "
            f"invariants {'held' if leak['ok'] else 'VIOLATED'}, live: {', '.join(leak['live'])}.",
        ]
        lines += [_held_line(r) for r in leak.get("replicas", []) if leak["held_blocks"]]
    return lines


def _held_line(r: dict[str, Any]) -> str:
    return (
        f"- {r['deployment']} `{r['engine_id']}`: {r['num_in_use_blocks']} in use, {r['num_pinned_blocks']} pinned, "
        f"{r['num_reserved_blocks']} reserved of {r['num_total_blocks']}; {r['num_requests']} requests, "
        f"{r['num_pinned_requests']} pinned, {r['num_reserved_requests']} reserved; problems: {r['problems'] or 'none'}"
    )


def _kill_lines(kills: list[dict[str, Any]]) -> list[str]:
    header = [
        "#",
        "replica",
        "request",
        "its client saw",
        "others in flight or sent before the restart",
        "restart",
        "first OK after crash",
        "recovered",
    ]
    rows = []
    for n, kill in enumerate(kills, 1):
        saw = kill["client_saw"] or {}
        cause = f" `{saw['cause']}`" if saw.get("cause") else ""
        own = f"{saw.get('result')}{cause} after {saw.get('tokens')} text chunks"
        rows.append(
            [
                str(n),
                kill["kind"],
                f"`{kill['request_id']}`",
                own,
                _counts(kill["affected"]),
                _s(kill["restart_s"]),
                _s(kill.get("first_ok_after_crash_s")),
                _s(kill["recover_s"]),
            ]
        )
    return _table(header, rows)


def _memory_lines(rows: list[dict[str, Any]]) -> list[str]:
    table = []
    for m in rows:
        growth = "not judged (< 60 s)" if m["growth"] is None else f"{m['growth']:+.1%}"
        state = "live at the end" if m["live_at_end"] else f"gone at {m['last_seen_s']:.0f} s (killed)"
        table.append(
            [
                m["deployment"],
                f"`{m['engine_id'][:12]}`",
                f"{max(0.0, m['first_seen_s']):.0f} s",
                state,
                _mib(m["warm_rss"]),
                _mib(m["last_rss"]),
                growth,
            ]
        )
    return _table(
        ["deployment", "engine", "first seen", "", "RSS after warm-up (MiB)", "RSS last (MiB)", "growth"], table
    )


def _log_lines(logs: dict[str, Any]) -> list[str]:
    lines = [f"From the Ray session's `logs/serve/*.log` and `worker-*.err` (kept in `{logs.get('dir')}`):", ""]
    expected = logs.get("expected", {})
    lines += [f"- {name}: {expected[name]} lines" for name in EXPECTED_LOG if name in expected]
    for key, title in (
        ("unexpected", "unexpected in the ingress and engine replicas (tracebacks, errors not injected)"),
        ("other_warnings", "other warnings of the ingress and engine replicas"),
        ("serve_internal", "warnings, errors and tracebacks of Ray Serve's own controller and proxy"),
    ):
        lines.append(f"- {title}: {logs.get(key + '_count', 0)}")
        lines += [f"  - {row['count']} x `{row['line']}`" for row in logs.get(key, [])[:10]]
    return lines


def render_mode(summary: dict[str, Any]) -> list[str]:
    """One mode's section."""
    s = summary["settings"]
    lines = [
        f"## {summary['mode']} mode",
        "",
        f"Command: `{summary['command']}`  ",
        f"Run {summary['date']} on {summary['machine']}, Ray {summary['ray']}.  ",
        f"Setup: 1 prefill + 1 decode replica, `transport.kv_transfer_timeout_s={s['kv_transfer_timeout_s']:g}`, "
        f"burst of {s['concurrency']} concurrent streams ({s['burst_disconnect']:.0%} disconnected at random "
        f"points), then a {s['soak_s']:.0f} s soak at {s['rate']:g} req/s Poisson ({s['soak_disconnect']:.0%} "
        f"disconnected), a kill every {s['kill_every_s']:.0f} s (prefill and decode in turn), a stalled transfer "
        f"every {s['stall_every_s']:.0f} s.",
        "",
        "### Targets",
        "",
    ]
    lines += _table(
        ["check", "target", "measured", "met"],
        [[v["check"], v["target"], v["measured"], "yes" if v["met"] else "**NO**"] for v in verdict(summary)],
    )
    lines += ["", "### Per fault", ""]
    rows = [_fault_line(summary, spec) for spec in summary["faults"]]
    disconnect = {"name": "client disconnect", "kind": "disconnect", "rules": [], "effect": "by design"}
    rows.append(_fault_line(summary, disconnect))
    lines += _table(
        ["fault", "rules (`faults:`)", "met", "what the client saw", "time to recover", "blocks leaked after"], rows
    )
    lines += ["", "### Requests by outcome", ""]
    lines += _phase_lines("Burst", summary["burst"]) + [""] + _phase_lines("Soak", summary["soak"])
    lines += ["", "### Kills", ""] + _kill_lines(summary["kills"])
    lines += ["", "### Memory", ""] + _memory_lines(summary["memory"])
    lines += ["", "### Logs", ""] + _log_lines(summary["logs"])
    return lines + _outside_lines(summary)


def _outside_lines(summary: dict[str, Any]) -> list[str]:
    """The requests that ended outside the contract, and the invariant violations, if any."""
    lines: list[str] = []
    anomalies = [a for p in ("burst", "soak") for a in summary[p]["anomalies"]]
    if anomalies:
        lines += ["", "Requests that ended outside the contract (hangs, silent cuts, 500s, client errors):", ""]
        lines += _table(
            ["request", "result", "cause", "sent", "ended", "text chunks"],
            [[f"`{a['request_id']}`", a["result"], a["cause"] or "", _s(a["sent_s"]), _s(a["end_s"]),
              str(a["num_tokens"])] for a in anomalies],
        )  # fmt: skip
    violations = summary.get("invariant_violations", [])
    if violations:
        lines += ["", "Invariant violations seen:", ""]
        lines += [f"- {v['t_s']:.0f} s, {v['deployment']} `{v['engine_id'][:12]}`: {v['problems']}" for v in violations]
    return lines


def render(merged: dict[str, dict[str, Any]], previous: str = "") -> str:
    """``docs/reliability.md`` from every mode's summary (pull first): the generated block
    between ``BEGIN`` and ``END``, then what followed ``END`` in ``previous`` (the hand-written
    findings), or a placeholder for them and the limits."""
    lines = [
        TITLE,
        BEGIN,
        "",
        "Generated by `python -m bench.reliability` (`bench/reliability.py`); the numbers are in "
        "`docs/benchmarks/reliability.json`.",
        "",
    ]
    for mode in sorted(merged, key=lambda m: (m != "pull", m)):
        lines += render_mode(merged[mode]) + [""]
    tail = previous.split(END, 1)[1] if END in previous else "\n\n" + FINDINGS + "\n" + LIMITS
    return "\n".join(lines) + END + tail
