"""bench.scaling's figures on a hand-made run (no Ray): per-step stats, what followed a
replica-count decision (from the polls and the Serve log lines), lost requests, and a report
rendered from the raw folder into its section of the page."""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.host import tokenizer
from bench.scaling import (
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    CpuMeter,
    ScalingRun,
    Step,
    _short,
    excerpt,
    load_runs,
    parse_options,
    request,
    save_run,
    scale_timings,
    scaling_lines,
    step_stats,
    write_report,
)
from bench.serve import polled
from workloads import PromptBuilder

WALL0 = time.mktime((2026, 12, 1, 10, 0, 0, 0, 0, -1))  # the load's start


def _record(ttft: float, tokens: int, usage: int | None = None, error: str | None = None) -> dict:
    chunks = [] if error else [round(ttft + 0.1 * k, 3) for k in range(tokens)]
    usage = tokens if usage is None and not error else usage
    last = chunks[-1] if chunks else None
    return {"prompt_tokens": 64, "max_tokens": tokens, "sent": 0.0, "chunks": chunks, "last": last,
            "usage_prompt_tokens": 64, "usage_output_tokens": usage, "error": error}  # fmt: skip


def _poll(t: float, reporting: int, target: int, lent: bool, running: int = 0) -> dict:
    replicas = [{"deployment": "PrefillServer", "replica": "p", "role": "both" if lent else "prefill", "running": 0}]
    replicas += [
        {"deployment": "DecodeServer", "replica": f"d{i}", "role": "decode", "running": running}
        for i in range(reporting)
    ]
    pools = {"decode": {"target": target, "reporting": reporting, "pending": 0}}
    return {"t": t, "replicas": replicas, "scaling": {"pools": pools}, "cpu": {"machine": 1.5, "ours": 1.25}}


def _log(t: float, text: str) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(WALL0 + t))
    return f"controller_1.log: INFO {stamp},000 controller 1 -- {text}"


def _run() -> ScalingRun:
    rows = [
        {"client": 0, "number": 0, "step": 0, "sent_s": 1.0, "record": _record(0.5, 5)},
        {"client": 1, "number": 0, "step": 1, "sent_s": 11.0, "record": _record(1.5, 5)},
        {"client": 1, "number": 1, "step": 1, "sent_s": 14.0, "record": _record(1.0, 5, usage=3)},  # short: lost
    ]
    timeline = [_poll(2.0, 1, 1, False), _poll(12.0, 1, 2, True), _poll(15.0, 2, 2, True, running=1)]
    decision = {"t": 12.5, "action": "scale_up", "pool": "decode", "replica": None, "role": None, "replicas": [1, 2],
                "reason": "decode: needs 2"}  # fmt: skip
    logs = [_log(13.0, "Adding 1 replica to Deployment(name='DecodeServer', app='bench').")]
    return ScalingRun("scaling", "python -m bench.scaling --steps 2:10,8:10", 60.0, 20.0, rows, timeline, [decision],
                      args={"model.max_model_len": "512"}, steps=(Step(2, 10.0), Step(8, 10.0)), log_lines=logs,
                      wall0=WALL0)  # fmt: skip


def test_step_stats_and_scale_timings():
    first, second = step_stats(_run())
    assert (first["requests"], first["lost"], second["requests"], second["lost"]) == (1, 0, 2, 1)
    assert first["tokens_per_s"] == pytest.approx(0.5) and second["tokens_per_s"] == pytest.approx(1.0)
    assert second["decode_reporting_mean"] == 1.5 and second["decode_target_max"] == 2
    assert second["prefill_lent_share"] == 1.0 and first["other_cores"] == pytest.approx(0.25)
    (timing,) = scale_timings(_run())
    assert (timing["first_s"], timing["all_s"], timing["load_s"], timing["serve_s"]) == (2.5, 2.5, 2.5, 0.5)


def test_report_from_the_raw_folder_fills_its_section(tmp_path):
    save_run(tmp_path / "raw", _run())
    (tmp_path / "elastic.md").write_text("# Elastic\n\nMine.\n")
    write_report(load_runs(tmp_path / "raw"), tmp_path)
    text = (tmp_path / "elastic.md").read_text()
    assert text.startswith("# Elastic\n\nMine.\n\n<!-- bench.scaling -->\n")
    assert "| 10-20 | 8 | 2 | 1 | 1.50 / 1.50 | 100 / 100 | 1.0 | 1.50 / 2 | 2 | 100% | 1.50 (0.25) |" in text
    assert "| scaling | 12.5 | scale_up | decode | 1 -> 2 | 0.5 s | never / never | 2.5 s | 2.5 s | 2.5 s |" in text
    assert "  - step 1, client 1, sent at 14.0 s: 3 of 5 tokens" in text
    assert (tmp_path / "scaling.png").stat().st_size > 0 and (tmp_path / "scaling.json").exists()


def test_a_scale_down_is_timed_from_the_serve_logs_and_its_lines_kept(tmp_path):
    run = _run()
    decision = {"t": 16.0, "action": "scale_down", "pool": "decode", "replicas": [2, 1], "reason": "calm"}
    worker = "worker-ab12-cd34-4242.err: INFO {} bench_DecodeServer r2 -- stopped: 0 request(s) left"
    logs = [
        _log(17.0, "Removing 1 replica from Deployment(name='DecodeServer', app='bench')."),
        _log(18.0, "Deployment 'DecodeServer' has 1 replicas that have taken more than 30s to be scheduled."),
    ]
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(WALL0 + 19.0))
    run = ScalingRun(**{**run.__dict__, "decisions": [decision], "log_lines": [*logs, worker.format(stamp + ",000")]})
    (timing,) = scale_timings(run)
    assert (timing["serve_s"], timing["stopped_s"], timing["stopped"]) == (1.0, 3.0, "stopped: 0 request(s) left")
    assert timing["load_s"] is None and timing["init_start_s"] is None
    kept = excerpt(run)
    assert len(kept) == 3 and kept[-1].startswith("worker-ab12")
    assert _short(kept[-1]).startswith("worker 4242 stderr: INFO")


def test_scaling_lines_come_from_the_serve_logs_and_the_workers_stderr(tmp_path):
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "controller_1.log").write_text("INFO x -- Adding 1 replica to D\nINFO x -- nothing\n")
    (tmp_path / "worker-1-2-3.err").write_text("INFO y -- stopped: 0 request(s) left\n")
    assert scaling_lines(tmp_path) == [
        "controller_1.log: INFO x -- Adding 1 replica to D",
        "worker-1-2-3.err: INFO y -- stopped: 0 request(s) left",
    ]


def test_requests_have_their_exact_length_and_no_shared_first_block():
    builder = PromptBuilder(tokenizer())
    first, second = request(builder, 0, 0), request(builder, 1, 0)
    assert len(first.prompt) == len(second.prompt) == PROMPT_TOKENS and first.max_tokens == OUTPUT_TOKENS
    assert first.prompt[:16] != second.prompt[:16]


def test_cpu_meter_and_options():
    sample = asyncio.run(CpuMeter().read())
    assert set(sample["cpu"]) == {"machine", "ours"} and all(v >= 0 for v in sample["cpu"].values())
    options = parse_options(["--steps", "2:10,4:20.5", "--systems", "lending"])
    assert options.steps == (Step(2, 10.0), Step(4, 20.5)) and options.systems == ("lending",)
    for bad in (["--steps", "2"], ["--steps", "0:10"], ["--systems", "elastic"]):
        with pytest.raises(SystemExit):
            parse_options(bad)


def test_polled_runs_the_load_with_the_autoscaler_polled_beside(capsys):
    async def load(t0: float) -> float:
        await asyncio.sleep(0.05)
        return time.perf_counter() - t0

    async def extra() -> dict:
        return {"cpu": {"machine": 1.0}}

    took, timeline, decisions, (_, wall0) = polled("http://127.0.0.1:9", load, True, extra, linger_s=0.1)
    assert took >= 0.05 and decisions == [] and abs(wall0 - time.time()) < 60
    assert timeline[0]["t"] >= 0.0 and timeline[0]["cpu"] == {"machine": 1.0} and "replicas" not in timeline[0]
    assert "autoscaler poll failed" in capsys.readouterr().err  # nothing listens there: the sample keeps its time
    assert polled("http://127.0.0.1:9", load, poll=False)[1:3] == ([], [])
