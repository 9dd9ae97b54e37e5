"""Serve's side of replica scaling: policy functions that follow the controller's decision.

The decision is made once for both pools by the autoscaler's controller
(``autoscaling/scale.py``). Each engine replica gets its deployment's target in the answer
to its report and returns it from ``record_autoscaling_stats`` as the custom metrics
``tandem_target_replicas`` and ``tandem_decision_seq`` (``autoscaling.messages.PoolTarget``:
the count and its decision's sequence number, the decision's wall-clock time); Serve's
controller runs the functions here each tick with those metrics:

- ``follow_decision(ctx)``: deployment level, set by the builder (``serve run
  app.config:disagg_app``, where Serve takes no application-level policy);
- ``follow_decisions(contexts)``: application level, for a Serve config YAML's
  ``applications[].autoscaling_policy``.

Both answer the newest decision any replica relayed, and hold the current target when none
did (the controller starting or restarting). The delays are the decision's own, so Serve's
``upscale_delay_s`` / ``downscale_delay_s`` are 0; Serve still applies min/max.

Why a relay and not a decision inside Serve's controller: the decision needs both pools'
loads and the latencies the ingress observed, which only our controller holds (Serve gives
each deployment-level policy its own deployment's metrics), and it must be the same
decision the fast path lends by.
"""

from __future__ import annotations

from typing import Any

from autoscaling.policy import Policy
from engine.params import Role

TARGET_METRIC = "tandem_target_replicas"
SEQ_METRIC = "tandem_decision_seq"
METRICS_INTERVAL_S = 0.5  # replicas push their metrics to Serve's controller this often
LOOK_BACK_PERIOD_S = 2.0


def serve_autoscaling_config(policy: Policy, pool: Role | str, initial_replicas: int) -> dict[str, Any]:
    """The ``autoscaling_config`` of the ``pool`` (``prefill`` / ``decode``) deployment."""
    bounds = policy.scaling.pool(Role(pool))
    return {
        "min_replicas": bounds.min_replicas,
        "max_replicas": bounds.max_replicas,
        "initial_replicas": initial_replicas,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "metrics_interval_s": METRICS_INTERVAL_S,
        "look_back_period_s": LOOK_BACK_PERIOD_S,
        "policy": {"policy_function": "autoscaling.serve_policy:follow_decision"},
    }


def _latest(series: Any) -> tuple[float, float] | None:
    """The newest (timestamp, value) of a replica's time series (a list of Serve's
    ``TimeStampedValue``), or None."""
    points = list(series or ())
    if not points:
        return None
    newest = max(points, key=lambda p: p.timestamp)
    return newest.timestamp, float(newest.value)


def relayed_target(raw_metrics: dict[str, dict[Any, Any]]) -> int | None:
    """The target of the newest decision among the replicas' relayed metrics."""
    targets, seqs = raw_metrics.get(TARGET_METRIC, {}), raw_metrics.get(SEQ_METRIC, {})
    best: tuple[float, float, int] | None = None
    for replica, series in targets.items():
        target, seq = _latest(series), _latest(seqs.get(replica))
        if target is None or seq is None:
            continue
        key = (seq[1], target[0], int(target[1]))  # the newest decision, then the newest sample
        if best is None or key > best:
            best = key
    return None if best is None else best[2]


def follow_decision(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Deployment-level policy: the decided target, or the current one when none arrived."""
    target = relayed_target(ctx.raw_metrics or {})
    return (ctx.target_num_replicas if target is None else target), {}


def follow_decisions(contexts: dict[Any, Any]) -> tuple[dict[Any, int], dict[Any, dict]]:
    """Application-level policy: each engine deployment follows the decision; the others
    (the ingress, the controller) keep their count."""
    return {dep: follow_decision(ctx)[0] for dep, ctx in contexts.items()}, {}
