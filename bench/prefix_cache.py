"""Prefix caching on a closed-loop multi-turn chat: ``python -m bench.prefix_cache``.

8 conversations of 5 turns at once through ``disagg_app`` (pull, fixed 1 + 1 pools), once with
``engine.enable_prefix_caching`` on and once off, each in a fresh local Ray: TTFT, TPOT, each
turn's ``cached_tokens``, the KV bytes moved (decode pool counter) and the prefill cache's hits,
then a lone ninth conversation turn by turn (the bytes of each turn's one fetch)."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
from ray import serve

from app.local_cluster import Server
from bench.host import cpu_model, machine, tokenizer
from bench.report import arguments, cells, command_line, figure, publish, read_json, subset, table, write_json
from bench.serve import SAMPLE, STREAM, client, stream
from bench.slo import RequestRecord, distribution
from workloads import ChatConversation, chat_conversations

NAME = "bench.prefix_cache"
SETTINGS = {"on": "true", "off": "false"}  # -> engine.enable_prefix_caching
# turn 5 is about 1,470 prompt + 100 output tokens; 1 GiB per replica holds every conversation's
# prefix in the prefill replica's cache, and all 8 conversations in the decode replica at turn 5
COMMON = {"model.max_model_len": "2048", "engine.kv_cache_bytes": str(1 << 30), "prefill.torch_threads": "1",
          "decode.torch_threads": "1", "transport.mode": "pull", "autoscaling.enabled": "false"}  # fmt: skip
COUNTERS = ("tandem_kv_transfer_bytes", "tandem_kv_transfer_seconds_count", "tandem_prefix_cache_hits",
            "tandem_prefix_cache_queries")  # fmt: skip
TRANSFERS = "tandem_kv_transfer_seconds_count/decode"  # the decode pool's transfers, as ``parse_counters`` keys it
METRICS_WAIT_S = 30.0  # for Ray's export to show every transfer of the loop
_POOL = re.compile(r'pool="([^"]*)"')
# metric | one setting's figure | the ratio: ``report.cells`` of a setting's summary, of the ratios
TABLE = """\
TTFT turns 2-5, median (ms) | {ttft_turns2_5_s[p50]:ms,.0f} | {ttft_turns2_5_p50_off_on:.2f}x
TTFT turns 2-5, p90 (ms) | {ttft_turns2_5_s[p90]:ms,.0f} | {ttft_turns2_5_p90_off_on:.2f}x
TTFT turn 1, median (ms) | {ttft_turn1_s[p50]:ms,.0f} | {ttft_turn1_p50_off_on:.2f}x
TTFT turn 1, p90 (ms) | {ttft_turn1_s[p90]:ms,.0f} |
TPOT median (ms) | {tpot_s[p50]:ms,.0f} | {tpot_p50_off_on:.2f}x
TPOT p90 (ms) | {tpot_s[p90]:ms,.0f} |
output tokens/s (whole loop) | {output_tokens_per_s:.1f} | on/off {output_tokens_per_s_on_off:.2f}x
loop duration (s) | {duration_s:.1f} | {duration_off_on:.2f}x
KV bytes moved per request (MB, decode pool counter) | {kv_bytes_per_request:MB.2f} | {kv_bytes_per_request_off_on:.2f}x
transfers counted / requests | {kv_transfers_counted} / {requests} |
prefill replica: prompt tokens from its cache | {prefill_prefix_hit_tokens:,} of {prefill_prefix_query_tokens:,} |
failed requests | {failed} |"""
TURN = (  # the per-turn table: a, b: the turn with caching on, off; la, lb: the lone conversation's
    "turn | prompt tokens (mean) | cached_tokens on: mean (min-max) | cached_tokens off: mean"
    " | TTFT median on / off (ms) | TTFT p90 on / off (ms) | lone: TTFT on / off (ms) | lone: KV moved on / off (MB)",
    "{a[turn]} | {a[prompt_tokens_mean]:.0f} | {a[cached_tokens_mean]:.0f}"
    " ({a[cached_tokens_min]}-{a[cached_tokens_max]}) | {b[cached_tokens_mean]:.0f}"
    " | {a[ttft_s][p50]:ms,.0f} / {b[ttft_s][p50]:ms,.0f} | {a[ttft_s][p90]:ms,.0f} / {b[ttft_s][p90]:ms,.0f}"
    " | {la[ttft_s]:ms,.0f} / {lb[ttft_s]:ms,.0f} | {la[kv_bytes]:MB.2f} / {lb[kv_bytes]:MB.2f}",
)


async def chat_turn(client: httpx.AsyncClient, url: str, model: str, chat: ChatConversation, answers: list) -> dict:
    """One turn of ``chat`` (its messages so far), streamed: the turn's row."""
    body = {"model": model, "messages": chat.messages(answers), "max_tokens": chat.max_tokens, **STREAM}
    record, texts = RequestRecord(0, chat.max_tokens, time.perf_counter()), []
    usage = await stream(client, url + "/v1/chat/completions", body, record, texts)
    times = (record.ttft, record.tpot, record.e2e) if record.ok else (None, None, None)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"conversation": chat.index, "turn": len(answers) + 1, "prompt_tokens": record.usage_prompt_tokens,
            "output_tokens": record.usage_output_tokens, "cached_tokens": cached,
            **dict(zip(("ttft_s", "tpot_s", "e2e_s"), times)), "error": record.error,
            "answer": "".join(texts)}  # fmt: skip


async def closed_loop(url: str, model: str, chats: list[ChatConversation], after_turn=None) -> tuple[list, float]:
    """All conversations at once, turn after turn (a failed one ends it); ``after_turn()`` adds to a row."""

    async def conversation(chat: ChatConversation) -> list[dict]:
        rows: list[dict] = []
        while len(rows) < chat.num_turns and (not rows or rows[-1]["error"] is None):
            rows.append(row := await chat_turn(http, url, model, chat, [r["answer"] for r in rows]))
            row |= await after_turn() if after_turn and row["error"] is None else {}
        return rows

    async with client() as http:
        start = time.perf_counter()
        done = await asyncio.gather(*map(conversation, chats))
        duration = time.perf_counter() - start
    return [turn for turns in done for turn in turns], duration


def parse_counters(text: str) -> dict[str, float]:
    """``COUNTERS`` in a Prometheus export, summed per pool, keyed ``name/pool`` (no ``ray_``, no ``_total``)."""
    totals: dict[str, float] = {}
    for match in map(SAMPLE.match, text.splitlines()):
        name = match and match.group(1).removeprefix("ray_").removesuffix("_total")
        pool = match and _POOL.search(match.group(2) or "")
        if name in COUNTERS and pool:
            key = f"{name}/{pool.group(1)}"
            totals[key] = totals.get(key, 0.0) + float(match.group(3))
    return totals


def counter_delta(metrics_url: str, before: dict[str, float], transfers: int, query_tokens: int) -> dict[str, float]:
    """The counters' change since ``before`` once Ray's export (a second or more behind) shows ``transfers`` on
    the decode pool and ``query_tokens`` on the prefill pool, or what it has after ``METRICS_WAIT_S``."""
    expected = {TRANSFERS: transfers, "tandem_prefix_cache_queries/prefill": query_tokens}
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        after = parse_counters(httpx.get(metrics_url, timeout=10).text)
        delta = {key: after[key] - before.get(key, 0.0) for key in after}
        if all(delta.get(k, 0.0) >= v for k, v in expected.items()) or time.monotonic() > deadline:
            return delta
        time.sleep(1.0)


def run_setting(setting: str, index: int, chats: list, lone: ChatConversation, extra: dict) -> dict:
    """One server's loop turns, counters, prefill stats and lone conversation (``extra``: on top of ``COMMON``)."""
    with Server("disagg", {**COMMON, **extra, "engine.enable_prefix_caching": SETTINGS[setting]}, index) as server:
        url, model = server.url, server.model()
        prefill = serve.get_deployment_handle("PrefillServer", app_name="bench")
        decode = serve.get_deployment_handle("DecodeServer", app_name="bench")
        _checked("warm-up", asyncio.run(closed_loop(url, model, [ChatConversation(-1, ("Say hello.",), 16)]))[0])
        # the baseline once the export shows the warm-up (else the loop's delta would count it)
        start = prefill.stats.remote().result()
        before = counter_delta(server.metrics_url, {}, 1, start.prefix_query_tokens)
        print(f"{setting}: closed loop of {len(chats)} conversations", file=sys.stderr)
        turns, duration = asyncio.run(closed_loop(url, model, chats))
        end = prefill.stats.remote().result()
        queried = end.prefix_query_tokens - start.prefix_query_tokens
        counters = counter_delta(server.metrics_url, before, sum(t["error"] is None for t in turns), queried)
        print(f"{setting}: loop {duration:.1f} s; lone conversation", file=sys.stderr)

        async def fetch() -> dict:  # the decode replica's one fetch since the previous turn
            last = await decode.last_transfer.remote()
            return {"kv_bytes": int(last["bytes"]), "kv_transfer_s": last["seconds"]}

        lone_turns = _checked("lone conversation", asyncio.run(closed_loop(url, model, [lone], fetch))[0])
    prefill_stats = {"query_tokens": queried, "hit_tokens": end.prefix_hit_tokens - start.prefix_hit_tokens,
                     "evictions": end.num_evictions - start.num_evictions}  # fmt: skip
    return {"setting": setting, "duration_s": duration, "counters": counters, "prefill_stats": prefill_stats,
            "lone": lone_turns, "turns": turns}  # fmt: skip


def _checked(what: str, rows: list[dict]) -> list[dict]:
    if failed := [row for row in rows if row["error"] is not None]:
        raise RuntimeError(f"{what}, turn {failed[0]['turn']}: {failed[0]['error']}")
    return rows


def _p(values: list[float]) -> dict[str, float]:
    return {p: v for p, v in distribution(values).items() if p in ("p50", "p90")}


def summarize(raw: dict) -> dict:
    """One setting's figures from its raw rows (``run_setting``'s)."""
    ok = [row for row in raw["turns"] if row["error"] is None]
    counters, prefill = raw["counters"], raw["prefill_stats"]
    transfers, kv_bytes = int(counters.get(TRANSFERS, 0)), counters.get("tandem_kv_transfer_bytes/decode", 0.0)
    output_tokens = sum(row["output_tokens"] or 0 for row in ok)
    per_turn = []
    for turn in sorted({row["turn"] for row in ok}):
        mine = [row for row in ok if row["turn"] == turn]
        cached = [row["cached_tokens"] or 0 for row in mine]
        per_turn.append({"turn": turn, "requests": len(mine),
                         "prompt_tokens_mean": sum(row["prompt_tokens"] for row in mine) / len(mine),
                         "cached_tokens_mean": sum(cached) / len(mine), "cached_tokens_min": min(cached),
                         "cached_tokens_max": max(cached), "ttft_s": _p([row["ttft_s"] for row in mine])})  # fmt: skip
    return {"requests": len(raw["turns"]), "failed": len(raw["turns"]) - len(ok), "duration_s": raw["duration_s"],
            "output_tokens": output_tokens, "output_tokens_per_s": output_tokens / raw["duration_s"],
            "ttft_turn1_s": _p([row["ttft_s"] for row in ok if row["turn"] == 1]),
            "ttft_turns2_5_s": _p([row["ttft_s"] for row in ok if row["turn"] >= 2]),
            "tpot_s": _p([row["tpot_s"] for row in ok if row["tpot_s"] is not None]),
            "kv_transfers_counted": transfers, "kv_bytes_total": kv_bytes,
            "kv_bytes_per_request": kv_bytes / transfers if transfers else float("nan"),
            "prefill_prefix_hit_tokens": prefill["hit_tokens"], "prefill_prefix_query_tokens": prefill["query_tokens"],
            "prefill_prefix_evictions": prefill["evictions"], "per_turn": per_turn}  # fmt: skip


def ratios(on: dict, off: dict) -> dict[str, float]:
    """off / on for latencies and bytes (above 1: caching is better), on / off for throughput."""
    latencies = (("ttft_turns2_5", "p50"), ("ttft_turns2_5", "p90"), ("ttft_turn1", "p50"), ("tpot", "p50"))
    pairs = {f"{name}_{p}_off_on": (off[f"{name}_s"][p], on[f"{name}_s"][p]) for name, p in latencies}
    pairs["kv_bytes_per_request_off_on"] = (off["kv_bytes_per_request"], on["kv_bytes_per_request"])
    pairs["output_tokens_per_s_on_off"] = (on["output_tokens_per_s"], off["output_tokens_per_s"])
    pairs["duration_off_on"] = (off["duration_s"], on["duration_s"])
    return {key: a / b if b else float("nan") for key, (a, b) in pairs.items()}


def same_answers(on: dict, off: dict) -> dict[str, int]:
    """Turns whose greedy answer is the same with caching on and off (one divergence carries on)."""
    text = {(row["conversation"], row["turn"]): row["answer"] for row in off["turns"] if row["error"] is None}
    pairs = [(text[key], row["answer"]) for row in on["turns"] if (key := (row["conversation"], row["turn"])) in text]
    return {"compared": len(pairs), "identical": sum(a == b for a, b in pairs)}


def report(saved: dict) -> dict:
    raws, extra = saved["runs"], saved["extra"]
    summary = {"command": saved["command"], "elapsed_s": saved["elapsed_s"], "machine": f"{cpu_model()}; {machine()}",
               "settings_order": list(raws), "config": {**COMMON, **extra}, "extra_args": extra,
               "settings": {setting: summarize(raw) for setting, raw in raws.items()},
               "lone": {setting: raw["lone"] for setting, raw in raws.items()}}  # fmt: skip
    if "on" in raws and "off" in raws:
        summary["ratios"] = ratios(summary["settings"]["on"], summary["settings"]["off"])
        summary["answers"] = same_answers(raws["on"], raws["off"])
    return summary | {"git": saved.get("git")}


def render(s: dict) -> list[str]:
    on, off, r = s["settings"]["on"], s["settings"]["off"], s["ratios"]
    target, answers = r["ttft_turns2_5_p50_off_on"], s["answers"]
    specs = ([cell.strip() for cell in line.split("|")] for line in TABLE.splitlines())
    rows = [[name, cells(figure_, on), cells(figure_, off), cells(ratio, r)] for name, figure_, ratio in specs]
    lone = zip(on["per_turn"], off["per_turn"], s["lone"]["on"], s["lone"]["off"])
    turns = [cells(TURN[1], {"a": a, "b": b, "la": la, "lb": lb}) for a, b, la, lb in lone]
    return [
        f"Command: `{s['command']}` ({s['elapsed_s'] / 60:.1f} min in all; settings run in the order"
        f" {', '.join(s['settings_order'])}, each in a fresh local Ray).", "",
        f"Machine: {s['machine']} (a 2-core VM: prefill and decode replica get one core each).", "",
        *(["Also " + ", ".join(f"`{k}={v}`" for k, v in s["extra_args"].items()) + ".", ""] if s["extra_args"] else []),
        *table("metric | caching on | caching off | off / on", rows), "",
        f"Target (TTFT of turns 2-5, median, >= 2x lower with caching): {target:.2f}x,"
        f" {'met' if target >= 2 else 'MISSED'}.", "",
        'Per turn (the loop\'s 8 requests of each turn; "lone": a ninth conversation run alone afterwards,'
        " one turn at a time):", "", *table(TURN[0], turns), "",
        f"Answers: {answers['identical']} of {answers['compared']} turns gave the same greedy text with"
        " caching on and off.", "", "![TTFT per turn and KV bytes per turn](prefix_cache.png)",
    ]  # fmt: skip


def write_report(summary: dict, out: Path) -> None:
    publish(out, "prefix_cache", NAME, summary, render(summary), "# Prefix caching: a closed-loop multi-turn chat")
    with figure(out / "prefix_cache.png", 1, 2, (10, 3.8), legend={"fontsize": 8}) as (left, right, _):
        for setting, colour in (("on", "tab:green"), ("off", "tab:red")):
            turns, lone = summary["settings"][setting]["per_turn"], summary["lone"][setting]
            for p, style in (("p50", "-o"), ("p90", "--")):
                ttft = [t["ttft_s"][p] for t in turns]
                left.plot([t["turn"] for t in turns], ttft, style, color=colour, label=f"caching {setting}, {p}")
            right.plot([t["turn"] for t in lone], [t["kv_bytes"] / 1e6 for t in lone], "-o", color=colour)
        left.set(title="TTFT per turn (8 conversations at once)", xlabel="turn", ylabel="TTFT (s)", ylim=(0, None))
        right.set(title="KV moved to decode per turn (lone conversation)", xlabel="turn", ylabel="MB")
        for ax in (left, right):
            ax.set_xticks(range(1, 1 + len(summary["settings"]["on"]["per_turn"])))


def main(argv: list[str] | None = None) -> None:
    parser = arguments(NAME, __doc__, "docs/benchmarks", "folder for prefix_cache.md/json/png")
    parser.add_argument("--settings", **subset(SETTINGS, "setting", help="prefix caching settings, in run order:"))
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--user-tokens", type=int, default=200, help="new user tokens per turn")
    parser.add_argument("--output-tokens", type=int, default=100, help="output tokens per turn")
    parser.add_argument("--raw", type=Path, default=Path("/tmp/tandem-prefix-cache"), help="per-request records")
    kv = {"action": "append", "default": [], "metavar": "KEY=VALUE"}
    parser.add_argument("--set", **kv, help="a disagg_app argument for every setting (repeatable)")
    parser.add_argument("--report-only", action="store_true", help="render the report from --raw, run nothing")
    args = parser.parse_args(argv)
    if any("=" not in item for item in args.set):
        parser.error("--set takes KEY=VALUE")
    raw_path = args.raw / "runs.json"
    summary = report(read_json(raw_path) if args.report_only else run_all(args, raw_path, command_line(NAME, argv)))
    if "ratios" in summary:
        write_report(summary, args.out)
    else:
        print(json.dumps(summary["settings"], indent=1))
    print(f"records: {raw_path}", file=sys.stderr)


def run_all(args: argparse.Namespace, raw_path: Path, command: str) -> dict:
    extra = dict(item.split("=", 1) for item in args.set)
    chats = chat_conversations(tokenizer(), args.conversations + 1, args.turns, args.user_tokens, args.output_tokens)
    # the checkout a run used: HEAD and the files changed from it (others may edit meanwhile)
    head, changed = (subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()
                     for a in (("rev-parse", "HEAD"), ("status", "--porcelain")))  # fmt: skip
    git = {"head": head, "changed": changed.splitlines()}
    started, saved = time.time(), {"command": command, "elapsed_s": 0.0, "extra": extra, "git": git, "runs": {}}
    for index, setting in enumerate(args.settings):
        saved["runs"][setting] = run_setting(setting, index, chats[:-1], chats[-1], extra)
        saved["elapsed_s"] = time.time() - started
        write_json(raw_path, saved, indent=None)
    return saved


if __name__ == "__main__":
    main()
