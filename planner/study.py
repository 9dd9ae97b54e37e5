"""``python -m planner.study``: what lending and replica scaling buy on a GPU cluster, on a
production trace (docs/benchmarks/elastic_at_scale.md).

The Azure conversation trace (one hour) at ``--rate-scale`` K, an 8B-class model
(``planner/models/llama-8b.json``) on H100s, one engine profile (``--engine``: ``h200-fused``,
this engine as it ships on a GPU, measured; ``h200-graphs``, its CUDA graphs of the model's own
forward; ``h200-eager``, its first, eager run; ``1.2x``, an engine at 1.2x the roofline), and
seven systems, each on the same requests (``planner.replay``'s simulation, the autoscaler's own functions):

* ``a`` colocated with chunked prefill: the fewest replicas that hold the target over the hour;
* ``b`` static P/D sized for the busiest 5-minute window (the fewest P, then D, that hold it);
* ``c`` static P/D with as many GPUs as ``f`` holds on average, at ``b``'s ratio;
* ``d60`` / ``d300`` replica scaling only (no lending, no prompt placement), start-up 60 s / 300 s;
* ``e`` lending and prompt placement only, fixed counts as ``c``;
* ``f`` lending, prompt placement and replica scaling (``--policy``, start-up 60 s);
* ``g`` the oracle: each window served by the pools sized for it alone (as ``b`` for the
  peak), with no start-up delay: the least GPU-hours any scaling could reach.

Sizing simulates the window from ``WARMUP_S`` before it and judges the window's own arrivals.
Writes ``<out>/elastic_at_scale.json`` (merged per profile), the generated block of
``<out>/elastic_at_scale.md`` and ``<out>/elastic_at_scale_<profile>.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoscaling.policy import Policy, Scaling, load_policy
from planner import replay
from planner.sim_types import SimRequest
from planner.simulator import simulate

TRACE = Path(__file__).parents[1] / "workloads" / "traces" / "azure_llm_2023_conv.csv"
WINDOW_S = 300.0
WARMUP_S = 60.0
TARGET = 0.9
SIZE_TARGET = 0.93  # a window sized to hold a little above the target, as a user would leave headroom
MAX_REPLICAS = 256
SYSTEMS = {
    "a": "colocated, chunked prefill, fewest replicas holding the target over the hour",
    "b": "static P/D sized for the busiest window",
    "c": "static P/D with f's mean GPUs, at b's ratio",
    "d60": "replica scaling only, start-up 60 s",
    "d300": "replica scaling only, start-up 300 s",
    "e": "lending + prompt placement only, counts as c",
    "f": "lending + prompt placement + replica scaling (start-up 60 s)",
    "g": "oracle: each window right-sized, no start-up delay",
}


@dataclass
class Study:
    engine: str
    requests: list[SimRequest]
    slo: tuple[float, float]
    policy: str
    seed: int
    runs: int = 0  # simulations so far
    sim_s: float = 0.0

    def args(self, **overrides: Any) -> argparse.Namespace:
        ttft, tpot = self.slo
        common = dict(trace=TRACE, model="llama-8b", gpu="h100", engine=self.engine, slo_ttft=ttft, slo_tpot=tpot)
        return replay.with_defaults(**(common | {"seed": self.seed, "window_s": WINDOW_S} | overrides))

    def window(self, index: int) -> tuple[float, float]:
        return index * WINDOW_S, (index + 1) * WINDOW_S

    @property
    def num_windows(self) -> int:
        return math.ceil((max(r.arrival_s for r in self.requests) - 1.0) / WINDOW_S)  # the replays' jitter is < 1 s


def attainments(study: Study, start: float, end: float, **system: Any) -> dict[str, float]:
    """Attainment (both, TTFT, TPOT) of the arrivals in [start, end), simulated from ``WARMUP_S`` before."""
    begin = max(start - WARMUP_S, 0.0)
    requests = [r for r in study.requests if begin <= r.arrival_s < end]
    planned = replay.setup(study.args(**system))
    started = time.perf_counter()
    result = simulate(planned.system, requests)
    study.runs, study.sim_s = study.runs + 1, study.sim_s + time.perf_counter() - started
    mine = [r for r in result.records if start <= r.arrival_s < end]
    summary = replay.latency_summary(mine, *study.slo)
    return {k: summary[k] for k in ("attainment", "ttft_attainment", "tpot_attainment")}


def smallest(holds: Callable[[int], bool], low: int = 1, high: int = MAX_REPLICAS) -> int:
    """The least n in [low, high] for which ``holds`` (assumed monotone); ``high`` when none below does."""
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if holds(middle) else (middle + 1, high)
    return low


def size_pools(study: Study, start: float, end: float) -> tuple[int, int]:
    """The fewest prefill replicas whose TTFTs hold with decode to spare, then the fewest decode
    replicas that hold both; then grown and trimmed as ``fit_pools`` does."""
    spare = MAX_REPLICAS

    def ttft_holds(p: int) -> bool:
        return attainments(study, start, end, prefill=p, decode=spare)["ttft_attainment"] >= SIZE_TARGET

    prefill = smallest(ttft_holds)

    def both_hold(d: int) -> bool:
        return attainments(study, start, end, prefill=prefill, decode=d)["attainment"] >= SIZE_TARGET

    row = fit_pools(study, start, end, [prefill, smallest(both_hold)])
    return row["prefill"], row["decode"]


def fit_pools(study: Study, start: float, end: float, guess: list[int]) -> dict[str, Any]:
    """Pools for [start, end) from ``guess``: while the window misses, one replica more in the pool
    whose replica helps more (a TTFT can wait on decode's KV room, so the missing half does not
    say which); then each pool one fewer while the window still holds."""
    tried: dict[tuple[int, int], dict[str, float]] = {}

    def got(pools: list[int]) -> dict[str, float]:
        key = (pools[0], pools[1])
        if key not in tried:
            tried[key] = attainments(study, start, end, prefill=key[0], decode=key[1])
        return tried[key]

    pools = list(guess)
    for _ in range(2 * MAX_REPLICAS):
        if got(pools)["attainment"] >= SIZE_TARGET:
            break
        pools = max(([n + (i == k) for i, n in enumerate(pools)] for k in (0, 1)), key=lambda o: got(o)["attainment"])
    for pool in (0, 1):
        while pools[pool] > 1:
            fewer = [n - (i == pool) for i, n in enumerate(pools)]
            if got(fewer)["attainment"] < SIZE_TARGET:
                break
            pools = fewer
    return {"prefill": pools[0], "decode": pools[1], **got(pools)}


def run_hour(study: Study, **system: Any) -> dict[str, Any]:
    planned = replay.setup(study.args(**system))
    data = replay.measure(planned, study.requests, WINDOW_S)
    study.runs, study.sim_s = study.runs + 1, study.sim_s + data["wall_s"]
    return data | {"system_args": dict(system)}


def policy_variant(study: Study, lending: bool, scaling: bool) -> Policy:
    """The study's policy with lending and prompt placement, or replica scaling, turned off."""
    policy = load_policy(study.policy)
    updates: dict[str, Any] = {}
    if not lending:
        updates |= {"max_lent": 0, "prompt_placement": policy.prompt_placement.model_copy(update={"enabled": False})}
    if not scaling:
        updates["scaling"] = Scaling(enabled=False)
    return policy.model_copy(update=updates)


def _load(requests: list[SimRequest], start: float, end: float) -> tuple[float, float]:
    """Prompt tokens and output tokens x their mean context, arriving in [start, end)."""
    mine = [r for r in requests if start <= r.arrival_s < end]
    return sum(r.prompt_tokens for r in mine), sum(
        r.output_tokens * (r.prompt_tokens + r.output_tokens / 2) for r in mine
    )


def oracle(study: Study, peak: int, sizes: tuple[int, int]) -> list[dict[str, Any]]:
    """Each window's own pools, searched from the peak's scaled by the window's load."""
    peak_load = _load(study.requests, *study.window(peak))
    rows = []
    for index in range(study.num_windows):
        load = _load(study.requests, *study.window(index))
        guess = [max(1, math.ceil(n * w / max(p, 1))) for n, w, p in zip(sizes, load, peak_load)]
        rows.append({"window": index, **fit_pools(study, *study.window(index), guess)})
    return rows


def oracle_summary(study: Study, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The oracle as a system: its windows' attainment and the GPU-hours of its sizes."""
    last = max(r.arrival_s for r in study.requests)
    spans = [min(study.window(r["window"])[1], last) - study.window(r["window"])[0] for r in rows]
    hours = sum((r["prefill"] + r["decode"]) * span for r, span in zip(rows, spans)) / 3600
    windows = [{"start_s": study.window(r["window"])[0], "attainment": r["attainment"],
                "mean_replicas": {"prefill": r["prefill"], "decode": r["decode"], "lent": 0,
                                  "held": r["prefill"] + r["decode"]}} for r in rows]  # fmt: skip
    worst = min(r["attainment"] for r in rows)
    return {"overall": {"gpu_hours": hours, "attainment": None, "worst_window": worst}, "windows": windows,
            "decisions": [], "sizes": rows}  # fmt: skip


def colocated_size(study: Study, peak: int) -> tuple[int, dict[str, Any]]:
    """The fewest colocated replicas holding the target over the hour, and that hour's run: the
    peak window's count, then bisected downward on whole-hour runs."""
    start, end = study.window(peak)
    at_peak = smallest(lambda n: attainments(study, start, end, colocated=n)["attainment"] >= TARGET)
    hours: dict[int, dict[str, Any]] = {}

    def hour(n: int) -> dict[str, Any]:
        if n not in hours:
            hours[n] = run_hour(study, colocated=n)
        return hours[n]

    n = smallest(lambda n: hour(n)["overall"]["attainment"] >= TARGET, max(1, 2 * at_peak // 3), at_peak)
    return n, hour(n)


def run_study(study: Study, log: Callable[[str], None]) -> dict[str, Any]:
    """Every system on the study's requests; the sizes and searches that led to them."""
    counts = [sum(1 for r in study.requests if study.window(i)[0] <= r.arrival_s < study.window(i)[1])
              for i in range(study.num_windows)]  # fmt: skip
    peak = max(range(len(counts)), key=counts.__getitem__)
    b_sizes = size_pools(study, *study.window(peak))
    log(f"b: P {b_sizes[0]} D {b_sizes[1]} for window {peak}")
    sizes = oracle(study, peak, b_sizes)
    log(f"g: {[(r['prefill'], r['decode']) for r in sizes]}")
    first = (sizes[0]["prefill"], sizes[0]["decode"])
    scaled = policy_variant(study, lending=False, scaling=True)
    systems: dict[str, dict[str, Any]] = {"g": oracle_summary(study, sizes)}
    systems["b"] = run_hour(study, prefill=b_sizes[0], decode=b_sizes[1])
    systems["f"] = run_hour(study, prefill=first[0], decode=first[1], policy=study.policy, startup_s=60.0)
    mean_gpus = systems["f"]["overall"]["gpu_hours"] * 3600 / systems["f"]["overall"]["duration_s"]
    c_prefill = max(1, round(mean_gpus * b_sizes[0] / sum(b_sizes)))
    c_sizes = (c_prefill, max(1, round(mean_gpus) - c_prefill))
    systems["c"] = run_hour(study, prefill=c_sizes[0], decode=c_sizes[1])
    lending = policy_variant(study, lending=True, scaling=False)
    systems["e"] = run_hour(study, prefill=c_sizes[0], decode=c_sizes[1], policy=lending)
    for startup in (60.0, 300.0):
        key = f"d{startup:.0f}"
        systems[key] = run_hour(study, prefill=first[0], decode=first[1], policy=scaled, startup_s=startup)
        log(f"{key}: {systems[key]['overall']['attainment']:.3f}")
    n, systems["a"] = colocated_size(study, peak)
    for system in systems.values():
        system.pop("timeline", None)
        system.get("system_args", {}).pop("policy", None)
    return {"peak_window": peak, "arrivals_per_window": counts, "sizes": {"a": n, "b": b_sizes, "c": c_sizes},
            "systems": systems}  # fmt: skip


# ---- the report ------------------------------------------------------------------------------


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def system_row(name: str, data: dict[str, Any], study: dict[str, Any]) -> dict[str, Any]:
    """One system's figures: GPUs, attainment overall / worst and peak window, saving against b
    as a share of the oracle's."""
    o, windows, peak = data["overall"], data["windows"], study["peak_window"]
    attained = [w["attainment"] for w in windows if w["attainment"] is not None]
    b, g = (study["systems"][k]["overall"]["gpu_hours"] for k in ("b", "g"))
    kinds = [d["kind"] for d in data["decisions"]]
    return {
        "system": name, "gpu_hours": o["gpu_hours"], "attainment": o["attainment"],
        "worst_window": min(attained) if attained else None, "peak_window": windows[peak]["attainment"],
        "saving_share": (b - o["gpu_hours"]) / (b - g) if b - g > 0.01 * b else None,
        "lends": kinds.count("lend"), "scale_ups": kinds.count("scale_up"), "scale_downs": kinds.count("scale_down"),
    }  # fmt: skip


def hardest_window(study: dict[str, Any]) -> int:
    """The trace's worst 5-minute window: where the static deployment ``c`` attains the least."""
    attained = [w["attainment"] for w in study["systems"]["c"]["windows"]]
    return min(range(len(attained)), key=lambda i: 1.0 if attained[i] is None else attained[i])


def targets(rows: dict[str, dict[str, Any]], study: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(target, measured, met) for the issue's targets; the window ones in the busiest window and
    in the hardest one (``hardest_window``)."""
    f = rows["f"]
    out = [("f holds 90% in every window", _share(f["worst_window"]), (f["worst_window"] or 0) >= TARGET),
           ("f reaches 70% of the oracle's saving against b", _share(f["saving_share"]),
            (f["saving_share"] or 0) >= 0.7)]  # fmt: skip
    for label, index in (("busiest", study["peak_window"]), ("hardest", hardest_window(study))):
        at = {k: study["systems"][k]["windows"][index]["attainment"] or 0.0 for k in ("c", "d60", "d300", "e", "f")}
        for name in ("e", "f"):
            for other, points in (("c", 10), ("d60", 5), ("d300", 5)):
                gain = at[name] - at[other]
                out.append((f"{label} window ({index}): {name} beats {other} by {points} points", f"{100 * gain:+.1f}",
                            gain >= points / 100))  # fmt: skip
    return out


def render_profile(profile: str, study: dict[str, Any]) -> list[str]:
    rows = {name: system_row(name, data, study) for name, data in study["systems"].items()}
    s, peak = study["settings"], study["peak_window"]
    lines = [f"## Engine profile `{profile}`", "",
             f"Command: `{s['command']}`. {s['requests']:,} requests (the trace x {s['rate_scale']}), SLOs TTFT p90 "
             f"{s['slo_ttft']:g} s and TPOT p90 {s['slo_tpot']:g} s, policy `{s['policy']}`; "
             f"{s['runs']} simulations, {s['sim_s'] / 60:.1f} min of simulation, {s['wall_s'] / 60:.1f} min in all.",
             f"Busiest window: {peak} ({study['arrivals_per_window'][peak]:,} arrivals); "
             f"sizes: b P {study['sizes']['b'][0]} : D {study['sizes']['b'][1]}, c P {study['sizes']['c'][0]} : D "
             f"{study['sizes']['c'][1]}, a {study['sizes']['a']} colocated.", "",
             "| system | what | GPU-hours | attainment | worst window | peak window | saving vs b / oracle's | "
             "lends | scale-ups / downs |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in SYSTEMS:
        r = rows[name]
        lines.append(f"| {name} | {SYSTEMS[name]} | {r['gpu_hours']:.1f} | {_share(r['attainment'])} | "
                     f"{_share(r['worst_window'])} | {_share(r['peak_window'])} | {_share(r['saving_share'])} | "
                     f"{r['lends']} | {r['scale_ups']} / {r['scale_downs']} |")  # fmt: skip
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {'yes' if ok else '**no**'} |" for t, m, ok in targets(rows, study)]
    head = "| window | arrivals | " + " | ".join(SYSTEMS) + " |"
    lines += ["", "Attainment per 5-minute window:", "", head, "|---" * (len(SYSTEMS) + 2) + "|"]
    for i, count in enumerate(study["arrivals_per_window"]):
        cells = [_share(study["systems"][k]["windows"][i]["attainment"]) for k in SYSTEMS]
        lines.append(f"| {i} | {count:,} | " + " | ".join(cells) + " |")
    return lines + ["", f"![{profile}](elastic_at_scale_{profile}.png)", ""]


def render(merged: dict[str, Any]) -> list[str]:
    """The page's generated block (between its markers) for every profile in the study's JSON."""
    return ["", *(line for name in sorted(merged) for line in render_profile(name, merged[name]))]


MARKERS = ("<!-- generated by planner.study: begin -->", "<!-- generated by planner.study: end -->")


def write_page(path: Path, lines: list[str]) -> None:
    """Rewrite the generated block of ``path`` (a new page: the block and a place for the reading)."""
    text = (
        path.read_text()
        if path.exists()
        else ("# Elastic serving at cluster scale\n\n" + "\n".join(MARKERS) + "\n\n## Reading the results\n")
    )
    begin, end = (text.index(m) for m in MARKERS)
    path.write_text(text[:begin] + "\n".join([MARKERS[0], *lines, MARKERS[1]]) + text[end + len(MARKERS[1]) :])


def plot(profile: str, study: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (arrivals, held, attained) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    x = list(range(len(study["arrivals_per_window"])))
    arrivals.bar(x, [n / WINDOW_S for n in study["arrivals_per_window"]], color="grey")
    arrivals.set(ylabel="arrivals (req/s)", title=f"engine profile {profile}")
    for name, data in study["systems"].items():
        windows = data["windows"][: len(x)]  # a replay's jitter may reach past the last window
        held.plot(x, [w["mean_replicas"]["held"] for w in windows], marker="o", label=name)
        attained.plot(x, [100 * (w["attainment"] or 0) for w in windows], marker="o", label=name)
    held.set(ylabel="GPUs held (window mean)")
    attained.axhline(100 * TARGET, color="grey", linestyle="--", linewidth=1)
    attained.set(ylabel="SLO attainment (%)", xlabel="5-minute window", ylim=(0, 105))
    for ax in (held, attained):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m planner.study", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--engine",
        default="1.2x",
        help="h200-fused (this engine as measured on an H200), h200-graphs (graphs of the model's forward), "
        "h200-eager (its first, eager run) or 1.2x (the roofline's)",
    )
    parser.add_argument("--profile", help="the profile's name in the report (default: the engine)")
    parser.add_argument("--rate-scale", type=int, default=50, help="K: the trace's rate x K")
    parser.add_argument("--duration-s", type=float, help="the first seconds of the trace only (development)")
    parser.add_argument("--slo-ttft", type=float, default=2.0)
    parser.add_argument("--slo-tpot", type=float, default=0.1)
    parser.add_argument("--policy", default="gpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--render", action="store_true", help="only rewrite the page and plots from the JSON in --out")
    args = parser.parse_args(argv)
    path = args.out / "elastic_at_scale.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    if not args.render:
        profile, result = study_profile(args, argv)
        merged[profile] = result
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(merged, indent=1) + "\n")
    lines = render(merged)
    write_page(args.out / "elastic_at_scale.md", lines)
    for name, study in merged.items():
        plot(name, study, args.out / f"elastic_at_scale_{name}.png")
    print("\n".join(lines))
    return 0


def study_profile(args: argparse.Namespace, argv: list[str] | None) -> tuple[str, dict[str, Any]]:
    """Run every system for one engine profile: its name and its JSON."""
    started = time.perf_counter()
    trace = replay.with_defaults(trace=TRACE, duration_s=args.duration_s, rate_scale=args.rate_scale, seed=args.seed)
    requests = replay.load_requests(trace)
    study = Study(args.engine, requests, (args.slo_ttft, args.slo_tpot), args.policy, args.seed)
    result = run_study(study, lambda line: print(f"[{time.perf_counter() - started:7.0f} s] {line}", flush=True))
    settings = {"command": "python -m planner.study" + "".join(f" {a}" for a in (argv or sys.argv[1:])),
                "requests": len(requests), "rate_scale": args.rate_scale, "engine": args.engine, "policy": args.policy,
                "slo_ttft": args.slo_ttft, "slo_tpot": args.slo_tpot, "runs": study.runs, "sim_s": study.sim_s,
                "wall_s": time.perf_counter() - started}  # fmt: skip
    return args.profile or args.engine, result | {"settings": settings}


if __name__ == "__main__":
    sys.exit(main())
