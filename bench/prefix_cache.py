"""Prefix caching on a closed-loop multi-turn chat: ``python -m bench.prefix_cache``.

The workload (``workloads.chat_conversations``): 8 conversations of 5 turns run at once, each
turn 200 new user tokens and 100 output tokens (greedy, ``ignore_eos``), each turn's request
the whole conversation so far through ``/v1/chat/completions``, sent when the previous answer
ends. It runs through ``disagg_app`` (pull, fixed 1 + 1 pools, one torch thread per replica)
once per setting of ``engine.enable_prefix_caching`` (``on``, ``off``), each in a fresh local
Ray (``bench.ray_local.Server``). Per setting, after a warm-up request: the closed loop (TTFT
of turn 1 and turns 2-5, TPOT, tokens/s, each turn's ``cached_tokens``); the KV bytes moved
(the decode pool's ``tandem_kv_transfer_bytes_total`` over the loop, per transfer counted) and
the prefill replica's prefix-cache hits; a lone ninth conversation, one turn at a time (its
TTFT and the bytes of its one fetch, ``DecodeServer.last_transfer``).

Writes ``docs/benchmarks/prefix_cache.{md,json,png}`` (only the block between the markers of
the ``.md`` is regenerated) and the per-request records to ``--raw`` (never committed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.report import (
    cells,
    command_line,
    figure,
    first_paragraph,
    read_json,
    table,
    template,
    write_json,
    write_page,
)
from bench.slo import RequestRecord, distribution
from workloads import ChatConversation, chat_conversations

NAME = "bench.prefix_cache"
SETTINGS = {"on": "true", "off": "false"}  # -> engine.enable_prefix_caching
COMMON = {
    "model.max_model_len": "2048",  # turn 5: about 1,470 prompt + 100 output tokens
    # 1 GiB per replica (1,456 blocks of 16 tokens): every conversation's prefix fits in the
    # prefill replica's cache, and the decode replica holds all 8 at turn 5 (~800 blocks)
    "engine.kv_cache_bytes": str(1 << 30),
    "prefill.torch_threads": "1",
    "decode.torch_threads": "1",
    "transport.mode": "pull",
    "autoscaling.enabled": "false",
}
DOC = Path("docs/benchmarks")
COUNTERS = ("tandem_kv_transfer_bytes", "tandem_kv_transfer_seconds_count", "tandem_prefix_cache_hits",
            "tandem_prefix_cache_queries")  # fmt: skip
METRICS_WAIT_S = 30.0  # for Ray's export to show every transfer of the loop
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")
_POOL = re.compile(r'pool="([^"]*)"')


@dataclass
class Turn:
    """One request of a conversation: what the client saw, the usage and the answer's text."""

    conversation: int
    turn: int  # 1-based
    record: RequestRecord
    cached_tokens: int | None = None
    answer: str = ""

    def row(self) -> dict:
        r, ok = self.record, self.record.ok
        return {
            "conversation": self.conversation,
            "turn": self.turn,
            "prompt_tokens": r.usage_prompt_tokens,
            "output_tokens": r.usage_output_tokens,
            "cached_tokens": self.cached_tokens,
            "ttft_s": r.ttft if ok else None,
            "tpot_s": r.tpot if ok else None,
            "e2e_s": r.e2e if ok else None,
            "error": r.error,
            "answer": self.answer,
        }


async def chat_turn(
    client: httpx.AsyncClient, url: str, model: str, conversation: ChatConversation, answers: list[str]
) -> Turn:
    """Stream one turn of ``conversation`` (its messages so far); times taken as chunks arrive."""
    body = {"model": model, "messages": conversation.messages(answers), "max_tokens": conversation.max_tokens}
    body |= {"temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    turn = Turn(conversation.index, len(answers) + 1, RequestRecord(0, conversation.max_tokens, time.perf_counter()))
    record, texts = turn.record, []
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return turn
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk, now = json.loads(line[6:]), time.perf_counter()
                if "error" in chunk:
                    record.error = str(chunk["error"].get("message"))
                    continue
                record.last = now
                if usage := chunk.get("usage"):
                    record.usage_prompt_tokens = record.prompt_tokens = usage["prompt_tokens"]
                    record.usage_output_tokens = usage["completion_tokens"]
                    turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                if text := "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices", ())):
                    record.chunks.append(now)
                    texts.append(text)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    turn.answer = "".join(texts)
    if record.error is None and not record.chunks:
        record.error = "no tokens received"
    return turn


async def closed_loop(url: str, model: str, conversations: list[ChatConversation]) -> tuple[list[Turn], float]:
    """All conversations at once, each turn sent when the previous answer has ended; every turn
    and the loop's duration."""

    async def conversation_turns(conversation: ChatConversation) -> list[Turn]:
        turns: list[Turn] = []
        for _ in range(conversation.num_turns):
            turns.append(await chat_turn(client, url, model, conversation, [t.answer for t in turns]))
            if not turns[-1].record.ok:
                break  # the next prompt would need this answer
        return turns

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        done = await asyncio.gather(*map(conversation_turns, conversations))
        duration = time.perf_counter() - start
    return [turn for turns in done for turn in turns], duration


def scrape_counters(metrics_url: str) -> dict[str, float]:
    """``COUNTERS`` summed per pool, keyed ``name/pool`` (names without Ray's ``ray_`` prefix
    and the ``_total`` suffix)."""
    totals: dict[str, float] = {}
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        match = _SAMPLE.match(line)
        name = match and match.group(1).removeprefix("ray_").removesuffix("_total")
        pool = match and _POOL.search(match.group(2) or "")
        if name in COUNTERS and pool:
            key = f"{name}/{pool.group(1)}"
            totals[key] = totals.get(key, 0.0) + float(match.group(3))
    return totals


def counter_delta(metrics_url: str, before: dict[str, float], transfers: int, query_tokens: int) -> dict[str, float]:
    """The counters' change since ``before``, once the export shows at least ``transfers``
    transfers on the decode pool and ``query_tokens`` prefix queries on the prefill pool (Ray
    exports what the replicas record about a second later; the prefix counters only when Serve
    next reads the routing stats). After ``METRICS_WAIT_S`` it returns what it has: the report
    shows the counts it got."""
    expected = {
        "tandem_kv_transfer_seconds_count/decode": transfers,
        "tandem_prefix_cache_queries/prefill": query_tokens,
    }
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        after = scrape_counters(metrics_url)
        delta = {key: after[key] - before.get(key, 0.0) for key in after}
        if all(delta.get(k, 0.0) >= v for k, v in expected.items()) or time.monotonic() > deadline:
            return delta
        time.sleep(1.0)


def run_setting(setting: str, index: int, conversations: list, lone: ChatConversation, extra: dict) -> dict:
    """Everything measured on one server (``extra``: app arguments on top of ``COMMON``, the
    same for every setting): the loop's turns, its counters and prefill stats, the lone turns."""
    from ray import serve

    from bench.ray_local import Server

    with Server("disagg", {**COMMON, **extra, "engine.enable_prefix_caching": SETTINGS[setting]}, index) as server:
        model = server.model()
        prefill = serve.get_deployment_handle("PrefillServer", app_name="bench")
        decode = serve.get_deployment_handle("DecodeServer", app_name="bench")
        warm = asyncio.run(closed_loop(server.url, model, [ChatConversation(-1, ("Say hello.",), 16)]))[0][0]
        if not warm.record.ok:  # one short request through both replicas before anything is timed
            raise RuntimeError(f"warm-up request failed: {warm.record.error}")
        # the baseline once the export shows the warm-up (else the loop's delta would count it)
        stats_before = prefill.stats.remote().result()
        before = counter_delta(server.metrics_url, {}, 1, stats_before.prefix_query_tokens)
        print(f"{setting}: closed loop of {len(conversations)} conversations", file=sys.stderr)
        turns, duration = asyncio.run(closed_loop(server.url, model, conversations))
        stats = prefill.stats.remote().result()
        queried = stats.prefix_query_tokens - stats_before.prefix_query_tokens
        counters = counter_delta(server.metrics_url, before, sum(t.record.ok for t in turns), queried)
        print(f"{setting}: loop {duration:.1f} s; lone conversation", file=sys.stderr)
        lone_turns = asyncio.run(_lone(server.url, model, lone, decode))
    prefill_stats = {"query_tokens": queried, "hit_tokens": stats.prefix_hit_tokens - stats_before.prefix_hit_tokens,
                     "evictions": stats.num_evictions - stats_before.num_evictions}  # fmt: skip
    return {"setting": setting, "duration_s": duration, "counters": counters, "prefill_stats": prefill_stats,
            "lone": lone_turns, "turns": [t.row() for t in turns]}  # fmt: skip


async def _lone(url: str, model: str, conversation: ChatConversation, decode) -> list[dict]:
    """One conversation alone, turn by turn; after each, the decode replica's last fetch (the
    only one since the previous turn, so its bytes are this turn's)."""
    rows, answers = [], []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for _ in range(conversation.num_turns):
            turn = await chat_turn(client, url, model, conversation, answers)
            if not turn.record.ok:
                raise RuntimeError(f"lone conversation, turn {turn.turn}: {turn.record.error}")
            fetch = await decode.last_transfer.remote()
            answers.append(turn.answer)
            rows.append({**turn.row(), "kv_bytes": int(fetch["bytes"]), "kv_transfer_s": fetch["seconds"]})
    return rows


# ---- figures ---------------------------------------------------------------------------------


def _p(values: list[float]) -> dict[str, float]:
    figures = distribution(values)
    return {"p50": figures["p50"], "p90": figures["p90"]}


def summarize(raw: dict) -> dict:
    """One setting's figures from its raw rows (``run_setting``'s)."""
    ok = [row for row in raw["turns"] if row["error"] is None]
    counters, prefill = raw["counters"], raw["prefill_stats"]
    transfers = int(counters.get("tandem_kv_transfer_seconds_count/decode", 0))
    kv_bytes = counters.get("tandem_kv_transfer_bytes/decode", 0.0)
    output_tokens = sum(row["output_tokens"] or 0 for row in ok)
    per_turn = []
    for turn in sorted({row["turn"] for row in ok}):
        mine = [row for row in ok if row["turn"] == turn]
        cached = [row["cached_tokens"] or 0 for row in mine]
        per_turn.append({"turn": turn, "requests": len(mine),
                         "prompt_tokens_mean": sum(row["prompt_tokens"] for row in mine) / len(mine),
                         "cached_tokens_mean": sum(cached) / len(mine), "cached_tokens_min": min(cached),
                         "cached_tokens_max": max(cached), "ttft_s": _p([row["ttft_s"] for row in mine])})  # fmt: skip
    return {
        "requests": len(raw["turns"]),
        "failed": len(raw["turns"]) - len(ok),
        "duration_s": raw["duration_s"],
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / raw["duration_s"],
        "ttft_turn1_s": _p([row["ttft_s"] for row in ok if row["turn"] == 1]),
        "ttft_turns2_5_s": _p([row["ttft_s"] for row in ok if row["turn"] >= 2]),
        "tpot_s": _p([row["tpot_s"] for row in ok if row["tpot_s"] is not None]),
        "kv_transfers_counted": transfers,
        "kv_bytes_total": kv_bytes,
        "kv_bytes_per_request": kv_bytes / transfers if transfers else float("nan"),
        "prefill_prefix_hit_tokens": prefill["hit_tokens"],
        "prefill_prefix_query_tokens": prefill["query_tokens"],
        "prefill_prefix_evictions": prefill["evictions"],
        "per_turn": per_turn,
    }


def ratios(on: dict, off: dict) -> dict[str, float]:
    """off / on for latencies and bytes (above 1: caching is better), on / off for throughput."""

    def div(a: float, b: float) -> float:
        return a / b if b else float("nan")

    return {
        "ttft_turns2_5_p50_off_on": div(off["ttft_turns2_5_s"]["p50"], on["ttft_turns2_5_s"]["p50"]),
        "ttft_turns2_5_p90_off_on": div(off["ttft_turns2_5_s"]["p90"], on["ttft_turns2_5_s"]["p90"]),
        "ttft_turn1_p50_off_on": div(off["ttft_turn1_s"]["p50"], on["ttft_turn1_s"]["p50"]),
        "tpot_p50_off_on": div(off["tpot_s"]["p50"], on["tpot_s"]["p50"]),
        "kv_bytes_per_request_off_on": div(off["kv_bytes_per_request"], on["kv_bytes_per_request"]),
        "output_tokens_per_s_on_off": div(on["output_tokens_per_s"], off["output_tokens_per_s"]),
        "duration_off_on": div(off["duration_s"], on["duration_s"]),
    }


def same_answers(on: dict, off: dict) -> dict[str, int]:
    """Turns whose greedy answer text is the same with caching on and off (a later turn's
    prompt holds the earlier answers, so one divergence carries into the rest)."""
    text = {(row["conversation"], row["turn"]): row["answer"] for row in off["turns"] if row["error"] is None}
    pairs = [(text[key], row["answer"]) for row in on["turns"] if (key := (row["conversation"], row["turn"])) in text]
    return {"compared": len(pairs), "identical": sum(a == b for a, b in pairs)}


def report(command: str, raws: dict[str, dict], elapsed_s: float, extra: dict[str, str]) -> dict:
    """The summary (``prefix_cache.json``) of the settings' raw runs."""
    from bench.host import cpu_model, machine

    summaries = {setting: summarize(raw) for setting, raw in raws.items()}
    summary = {
        "command": command,
        "elapsed_s": elapsed_s,
        "machine": f"{cpu_model()}; {machine()}",
        "settings_order": list(raws),
        "config": {**COMMON, **extra},
        "extra_args": extra,
        "settings": summaries,
        "lone": {setting: raw["lone"] for setting, raw in raws.items()},
    }
    if "on" in summaries and "off" in summaries:
        summary["ratios"] = ratios(summaries["on"], summaries["off"])
        summary["answers"] = same_answers(raws["on"], raws["off"])
    return summary


# ---- the page ----------------------------------------------------------------------------------


TABLE = (  # metric, one setting's figure, the ratio (``report.cells`` of a summary's, of its ratios)
    ("TTFT turns 2-5, median (ms)", "{ttft_turns2_5_s[p50]:ms,.0f}", "{ttft_turns2_5_p50_off_on:.2f}x"),
    ("TTFT turns 2-5, p90 (ms)", "{ttft_turns2_5_s[p90]:ms,.0f}", "{ttft_turns2_5_p90_off_on:.2f}x"),
    ("TTFT turn 1, median (ms)", "{ttft_turn1_s[p50]:ms,.0f}", "{ttft_turn1_p50_off_on:.2f}x"),
    ("TTFT turn 1, p90 (ms)", "{ttft_turn1_s[p90]:ms,.0f}", ""),
    ("TPOT median (ms)", "{tpot_s[p50]:ms,.0f}", "{tpot_p50_off_on:.2f}x"),
    ("TPOT p90 (ms)", "{tpot_s[p90]:ms,.0f}", ""),
    ("output tokens/s (whole loop)", "{output_tokens_per_s:.1f}", "on/off {output_tokens_per_s_on_off:.2f}x"),
    ("loop duration (s)", "{duration_s:.1f}", "{duration_off_on:.2f}x"),
    (
        "KV bytes moved per request (MB, decode pool counter)",
        "{kv_bytes_per_request:MB.2f}",
        "{kv_bytes_per_request_off_on:.2f}x",
    ),
    ("transfers counted / requests", "{kv_transfers_counted} / {requests}", ""),
    (
        "prefill replica: prompt tokens from its cache",
        "{prefill_prefix_hit_tokens:,} of {prefill_prefix_query_tokens:,}",
        "",
    ),
    ("failed requests", "{failed}", ""),
)
TURN = (  # the per-turn table: a, b: the turn with caching on, off; la, lb: the lone conversation's
    "turn | prompt tokens (mean) | cached_tokens on: mean (min-max) | cached_tokens off: mean"
    " | TTFT median on / off (ms) | TTFT p90 on / off (ms) | lone: TTFT on / off (ms) | lone: KV moved on / off (MB)",
    "{a[turn]} | {a[prompt_tokens_mean]:.0f} | {a[cached_tokens_mean]:.0f}"
    " ({a[cached_tokens_min]}-{a[cached_tokens_max]}) | {b[cached_tokens_mean]:.0f}"
    " | {a[ttft_s][p50]:ms,.0f} / {b[ttft_s][p50]:ms,.0f} | {a[ttft_s][p90]:ms,.0f} / {b[ttft_s][p90]:ms,.0f}"
    " | {la[ttft_s]:ms,.0f} / {lb[ttft_s]:ms,.0f} | {la[kv_bytes]:MB.2f} / {lb[kv_bytes]:MB.2f}",
)


def render(s: dict) -> list[str]:
    """The generated block of prefix_cache.md, from prefix_cache.json."""
    on, off, r = s["settings"]["on"], s["settings"]["off"], s["ratios"]
    target, answers = r["ttft_turns2_5_p50_off_on"], s["answers"]
    rows = [[name, cells(figure_, on), cells(figure_, off), cells(ratio, r)] for name, figure_, ratio in TABLE]
    lone = zip(on["per_turn"], off["per_turn"], s["lone"]["on"], s["lone"]["off"])
    turns = [cells(TURN[1], {"a": a, "b": b, "la": la, "lb": lb}) for a, b, la, lb in lone]
    return [
        f"Command: `{s['command']}` ({s['elapsed_s'] / 60:.1f} min in all; settings run in the order"
        f" {', '.join(s['settings_order'])}, each in a fresh local Ray).",
        "",
        f"Machine: {s['machine']} (a 2-core VM: prefill and decode replica get one core each).",
        "",
        "Setup: `disagg_app`, pull, fixed 1 prefill + 1 decode replica (`autoscaling.enabled=false`),"
        " one torch thread each, SmolLM2-135M-Instruct float32, `engine.kv_cache_bytes` 1 GiB per replica,"
        " context 2,048; `engine.enable_prefix_caching` on or off. Workload: 8 conversations at once, 5 turns"
        " each, 200 new user tokens and 100 output tokens (greedy, `ignore_eos`) per turn through"
        " `/v1/chat/completions`, each turn's request the conversation so far, sent when the previous answer"
        " ended (`workloads.chat_conversations`)." + "".join(f" Also `{k}={v}`." for k, v in s["extra_args"].items()),
        "",
        *table("metric | caching on | caching off | off / on", rows),
        "",
        f"Target (TTFT of turns 2-5, median, >= 2x lower with caching): {target:.2f}x,"
        f" {'met' if target >= 2 else 'MISSED'}.",
        "",
        'Per turn (the loop\'s 8 requests of each turn; "lone": a ninth conversation run alone afterwards,'
        " one turn at a time):",
        "",
        *table(TURN[0], turns),
        "",
        "KV bytes: the loop's figure is the change of the decode pool's `tandem_kv_transfer_bytes_total`"
        " (Ray's Prometheus export) over the loop divided by the transfers the same export counted"
        " (`tandem_kv_transfer_seconds_count`, checked against the requests above); the lone conversation's"
        " are `DecodeServer.last_transfer` after each turn, exact because nothing else runs."
        " `cached_tokens` is `usage.prompt_tokens_details.cached_tokens` (in pull mode: the prefill"
        " replica's cache).",
        "",
        f"Answers: {answers['identical']} of {answers['compared']} turns gave the same greedy text with"
        " caching on and off.",
        "",
        "![TTFT per turn and KV bytes per turn](prefix_cache.png)",
    ]


def write_report(summary: dict, out: Path) -> None:
    write_json(out / "prefix_cache.json", summary)
    new = template(NAME, "# Prefix caching: a closed-loop multi-turn chat")
    write_page(out / "prefix_cache.md", NAME, render(summary), new)
    with figure(out / "prefix_cache.png", 1, 2, (10, 3.8)) as (left, right, _):
        for setting, colour in (("on", "tab:green"), ("off", "tab:red")):
            turns, lone = summary["settings"][setting]["per_turn"], summary["lone"][setting]
            x = [t["turn"] for t in turns]
            left.plot(
                x, [t["ttft_s"]["p50"] for t in turns], marker="o", color=colour, label=f"caching {setting}, median"
            )
            left.plot(
                x, [t["ttft_s"]["p90"] for t in turns], linestyle="--", color=colour, label=f"caching {setting}, p90"
            )
            right.plot([t["turn"] for t in lone], [t["kv_bytes"] / 1e6 for t in lone], marker="o", color=colour)
        left.set(title="TTFT per turn (8 conversations at once)", xlabel="turn", ylabel="TTFT (s)")
        left.set_ylim(bottom=0)
        right.set(title="KV moved to decode per turn (lone conversation)", xlabel="turn", ylabel="MB")
        for ax in (left, right):
            ax.grid(alpha=0.3)
            ax.set_xticks(range(1, 1 + len(summary["settings"]["on"]["per_turn"])))
        left.legend(fontsize=8)


# ---- the command line ------------------------------------------------------------------------------


def git_tree() -> dict:
    """The checkout the run used: HEAD and the files changed from it (others edit concurrently)."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=False).stdout.strip()

    return {"head": git("rev-parse", "HEAD"), "changed": git("status", "--porcelain").splitlines()}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=NAME, description=first_paragraph(__doc__))
    parser.add_argument("--settings", default="on,off", help="prefix caching settings, in run order (on, off)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--user-tokens", type=int, default=200, help="new user tokens per turn")
    parser.add_argument("--output-tokens", type=int, default=100, help="output tokens per turn")
    parser.add_argument("--out", default=str(DOC), help="folder for prefix_cache.md/json/png")
    parser.add_argument("--raw", default="/tmp/tandem-prefix-cache", help="folder for per-request records")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a disagg_app argument for every setting (repeatable), e.g. engine.enable_chunked_prefill=true",
    )
    parser.add_argument("--report-only", action="store_true", help="render the report from --raw, run nothing")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    settings = [s for s in args.settings.split(",") if s]
    for setting in settings:
        if setting not in SETTINGS:
            sys.exit(f"unknown setting {setting!r}: choose from {', '.join(SETTINGS)}")
    if any("=" not in item for item in args.set):
        sys.exit("--set takes KEY=VALUE")
    extra, raw_path = dict(item.split("=", 1) for item in args.set), Path(args.raw) / "runs.json"
    if args.report_only:
        saved = read_json(raw_path)
        summary = report(saved["command"], saved["runs"], saved["elapsed_s"], saved["extra"])
        write_report({**summary, "git": saved.get("git")}, Path(args.out))
        return
    from bench.host import tokenizer

    words = tokenizer()
    *conversations, lone = chat_conversations(
        words, args.conversations + 1, args.turns, args.user_tokens, args.output_tokens
    )
    command, started, runs, tree = command_line(NAME, argv), time.time(), {}, git_tree()
    for index, setting in enumerate(settings):
        runs[setting] = run_setting(setting, index, conversations, lone, extra)
        saved = {"command": command, "elapsed_s": time.time() - started, "extra": extra, "git": tree, "runs": runs}
        write_json(raw_path, saved, indent=None)
    summary = {**report(command, runs, time.time() - started, extra), "git": tree}
    if "ratios" in summary:
        write_report(summary, Path(args.out))
    else:
        print(json.dumps(summary["settings"], indent=1))
    print(f"records: {raw_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
