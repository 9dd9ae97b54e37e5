"""Try a policy on a recorded trace before it runs: ``python -m autoscaling.replay POLICY TRACE.jsonl``.

``POLICY`` is a shipped policy's name or a YAML path; ``TRACE.jsonl`` is what the controller
wrote with ``autoscaling.record=PATH`` (one snapshot per decision interval). When the app set
``slo.ttft_ms`` / ``slo.tpot_ms``, pass them as ``--slo-ttft-ms`` / ``--slo-tpot-ms``. Prints the
decisions the policy takes on that trace -- lending (lend, reclaim, drained: the replica) and
replica counts (scale_up, scale_down, give_up: the pool and its counts) -- with the time
(seconds from the trace's start) and the reason. The decisions depend only on the snapshots, so the same trace and
policy always print the same table.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from autoscaling.decide import Action, ControllerState, decide
from autoscaling.policy import Policy, PolicyError, load_policy
from autoscaling.scale import ScaleEvent, ScaleState, decide_counts
from autoscaling.snapshot import Snapshot

Decision = Action | ScaleEvent


def read_trace(path: Path) -> Iterator[Snapshot]:
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    yield Snapshot.from_json(json.loads(line))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{number}: not a snapshot ({exc})") from None


def replay(snapshots: Iterable[Snapshot], policy: Policy) -> list[tuple[float, Decision]]:
    """Every decision ``policy`` takes on the trace, with the snapshot's time, in the
    controller's order: lending first, then the replica counts from the same snapshot."""
    state, scale, decisions = ControllerState(), ScaleState(), []
    for snapshot in snapshots:
        state = state.forget_missing(r.replica for r in snapshot.replicas)
        actions = decide(snapshot, policy, state)
        state = state.after(actions, snapshot.time)
        scale, events = decide_counts(snapshot, policy, scale, state.lent)
        decisions.extend((snapshot.time, decision) for decision in (*actions, *events))
    return decisions


def _subject(decision: Decision) -> str:
    if isinstance(decision, ScaleEvent):
        return f"{decision.pool.value} pool: {decision.old} -> {decision.new}"
    return decision.replica


def table(decisions: list[tuple[float, Decision]], start: float) -> str:
    rows = ["| time (s) | action | replica or pool | reason |", "|---|---|---|---|"]
    rows += [f"| {t - start:.1f} | {d.kind.value} | {_subject(d)} | {d.reason} |" for t, d in decisions]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoscaling.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("policy", help="a shipped policy's name (default, latency_first, cost_first) or a YAML path")
    parser.add_argument("trace", type=Path, help="JSONL written with autoscaling.record=PATH")
    parser.add_argument(
        "--slo-ttft-ms", type=float, help="the app's slo.ttft_ms, if it set one (in place of the policy's)"
    )
    parser.add_argument("--slo-tpot-ms", type=float, help="the app's slo.tpot_ms, if it set one")
    args = parser.parse_args(argv)
    try:
        policy = load_policy(args.policy).with_slo(args.slo_ttft_ms, args.slo_tpot_ms)
        snapshots = list(read_trace(args.trace))
    except (PolicyError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    decisions = replay(snapshots, policy)
    start = snapshots[0].time if snapshots else 0.0
    print(f"policy {policy.name}: {len(snapshots)} snapshots, {len(decisions)} decisions")
    print(table(decisions, start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
