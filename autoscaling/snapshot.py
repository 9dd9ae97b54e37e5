"""What the controller decides from: every engine replica's load and the latencies the
ingress observed, at one instant. Plain frozen data with a JSON form (the recorded
trace that ``python -m autoscaling.replay`` reads back)."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from autoscaling.messages import LatencySample
from engine.params import EngineStats, Role


@dataclass(frozen=True, kw_only=True)
class ReplicaLoad:
    """One engine replica as the controller sees it."""

    replica: str  # Serve's replica id
    deployment: str  # PrefillServer / DecodeServer
    home: Role  # the deployment's role: what the replica returns to
    role: Role  # its role now
    running: int
    decoding: int  # requests that decode here (whole or decode requests), waiting or running
    waiting: int
    queued_prompt_tokens: int
    free_blocks: int
    pinned_blocks: int
    total_blocks: int
    median_step_ms: float

    @classmethod
    def of(cls, replica: str, deployment: str, home: Role, stats: EngineStats) -> ReplicaLoad:
        return cls(
            replica=replica,
            deployment=deployment,
            home=home,
            role=stats.role,
            running=stats.num_running,
            decoding=stats.num_decoding,
            waiting=stats.num_waiting,
            queued_prompt_tokens=stats.num_queued_prompt_tokens,
            free_blocks=stats.num_free_blocks,
            pinned_blocks=stats.num_pinned_blocks,
            total_blocks=stats.num_total_blocks,
            median_step_ms=stats.median_step_ms,
        )

    @property
    def lent(self) -> bool:
        return self.home is Role.PREFILL and self.role is not Role.PREFILL

    @property
    def serves_decode(self) -> bool:
        return self.role in (Role.DECODE, Role.BOTH)

    @property
    def serves_prefill(self) -> bool:
        return self.role in (Role.PREFILL, Role.BOTH)

    @property
    def decode_blocks(self) -> int:
        """Blocks held by decodes (a lent replica's pinned blocks are its prompts' exports)."""
        return max(self.total_blocks - self.free_blocks - self.pinned_blocks, 0)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "home": self.home.value, "role": self.role.value}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReplicaLoad:
        return cls(**{**data, "home": Role(data["home"]), "role": Role(data["role"])})


@dataclass(frozen=True, kw_only=True)
class Observed:
    """Latencies the ingress saw over the policy's window (None: fewer than its min_samples)."""

    num_requests: int = 0
    ttft_p90_s: float | None = None
    tpot_p90_s: float | None = None
    prefill_p90_s: float | None = None  # the prefill call (pull) or TTFT (push) of disaggregated requests
    prompt_tokens_per_s: float | None = None  # prompt tokens admitted per second (``PromptArrivals``)
    seconds_per_prompt_token: float | None = None  # one prefill replica's compute per prompt token

    @classmethod
    def of(
        cls,
        samples: Sequence[LatencySample],
        min_samples: int,
        prompt_tokens_per_s: float | None = None,
        seconds_per_prompt_token: float | None = None,
    ) -> Observed:
        """``samples``: one per finished request; each p90 needs ``min_samples`` values of its own."""
        return cls(
            num_requests=len(samples),
            ttft_p90_s=_p90([s.ttft_s for s in samples], min_samples),
            tpot_p90_s=_p90([s.tpot_s for s in samples if s.tpot_s is not None], min_samples),
            prefill_p90_s=_p90([s.prefill_s for s in samples if s.prefill_s is not None], min_samples),
            prompt_tokens_per_s=prompt_tokens_per_s,
            seconds_per_prompt_token=seconds_per_prompt_token,
        )

    @property
    def prompt_work(self) -> float | None:
        """Prefill replicas' worth of prompt compute arriving: tokens per second x seconds per
        token (1.0: one replica computing prompts all the time); None until both are known."""
        if self.prompt_tokens_per_s is None or self.seconds_per_prompt_token is None:
            return None
        return self.prompt_tokens_per_s * self.seconds_per_prompt_token


class PromptArrivals:
    """Prompt tokens admitted over the last ``window_s``, from the time it started counting:
    the arrival rate the prefill pool is sized from (the controller's, and the simulator's)."""

    MIN_SPAN_S = 1.0  # a rate over less than this is no rate yet

    def __init__(self, window_s: float, started: float) -> None:
        self.window_s, self.started = window_s, started
        self._arrived: deque[tuple[float, int]] = deque()  # (at, tokens), the oldest first

    def add(self, now: float, tokens: int) -> None:
        if tokens:
            self._arrived.append((now, tokens))

    def rate(self, now: float) -> float | None:
        """Tokens per second over the window (over the time counted, while shorter)."""
        while self._arrived and self._arrived[0][0] <= now - self.window_s:
            self._arrived.popleft()
        span = min(self.window_s, now - self.started)
        return sum(tokens for _, tokens in self._arrived) / span if span >= self.MIN_SPAN_S else None


def _p90(values: list[float], min_samples: int = 1) -> float | None:
    if not values or len(values) < min_samples:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    time: float  # seconds, the controller's clock (monotonic in a trace)
    replicas: tuple[ReplicaLoad, ...] = ()
    observed: Observed = field(default_factory=Observed)

    def to_json(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "replicas": [r.to_json() for r in self.replicas],
            "observed": asdict(self.observed),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Snapshot:
        return cls(
            time=data["time"],
            replicas=tuple(ReplicaLoad.from_json(r) for r in data["replicas"]),
            observed=Observed(**data.get("observed", {})),
        )
