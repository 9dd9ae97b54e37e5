"""Try a policy on a recorded trace before it runs: ``python -m autoscaling.replay POLICY TRACE.jsonl``.

``POLICY`` is a shipped policy's name or a YAML path; ``TRACE.jsonl`` is what the controller
wrote with ``autoscaling.record=PATH`` (one snapshot per decision interval). When the app set
``slo.ttft_ms`` / ``slo.tpot_ms``, pass them as ``--slo-ttft-ms`` / ``--slo-tpot-ms``. Prints the
decisions the policy takes on that trace: time (seconds from the trace's start), action,
replica and reason. The decisions depend only on the snapshots, so the same trace and
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
from autoscaling.snapshot import Snapshot


def read_trace(path: Path) -> Iterator[Snapshot]:
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    yield Snapshot.from_json(json.loads(line))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{number}: not a snapshot ({exc})") from None


def replay(snapshots: Iterable[Snapshot], policy: Policy) -> list[tuple[float, Action]]:
    """Every decision ``policy`` takes on the trace, with the snapshot's time."""
    state, decisions = ControllerState(), []
    for snapshot in snapshots:
        state = state.forget_missing(r.replica for r in snapshot.replicas)
        actions = decide(snapshot, policy, state)
        state = state.after(actions, snapshot.time)
        decisions.extend((snapshot.time, action) for action in actions)
    return decisions


def table(decisions: list[tuple[float, Action]], start: float) -> str:
    rows = ["| time (s) | action | replica | reason |", "|---|---|---|---|"]
    rows += [f"| {t - start:.1f} | {a.kind.value} | {a.replica} | {a.reason} |" for t, a in decisions]
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
