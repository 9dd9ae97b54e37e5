"""Latency metrics, SLO attainment and goodput, as the published methods define them.

Per request (``vllm bench serve``): TTFT = first content chunk - send; E2E = last chunk - send; TPOT = (E2E - TTFT) /
(output tokens - 1); ITL = each gap between content chunks. Attainment (DistServe): the share of requests sent that
finished within both SLOs (a failure misses; a one-token output has no TPOT and meets that half). Goodput: the highest
rate whose attainment is still >= the target (90%), read off a rate sweep."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from planner.sim_types import distribution


@dataclass
class RequestRecord:
    """What the client saw of one request; times in seconds on one monotonic clock."""

    prompt_tokens: int  # asked for
    max_tokens: int
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk carrying text
    last: float | None = None  # arrival of the last data chunk (before [DONE])
    usage_prompt_tokens: int | None = None
    usage_output_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunks)

    @property
    def output_tokens(self) -> int:
        return self.usage_output_tokens if self.usage_output_tokens is not None else len(self.chunks)

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def e2e(self) -> float:
        return (self.last if self.last is not None else self.chunks[-1]) - self.sent

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens >= 2 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]

    def to_json(self) -> dict:
        """The JSON row of the reports' raw records: times relative to the send."""
        last = None if self.last is None else round(self.last - self.sent, 6)
        chunks = [round(t - self.sent, 6) for t in self.chunks]
        return asdict(self) | {"sent": round(self.sent, 6), "chunks": chunks, "last": last}

    @classmethod
    def from_json(cls, row: dict) -> RequestRecord:
        """Inverse of ``to_json``, sent at 0."""
        return cls(**{**row, "sent": 0.0})


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def met(self, record: RequestRecord) -> bool:
        return record.ok and record.ttft <= self.ttft_s and (record.tpot is None or record.tpot <= self.tpot_s)


def attainment(records: Sequence[RequestRecord], slo: SLO) -> float:
    return sum(slo.met(r) for r in records) / len(records) if records else 0.0


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO | None = None) -> dict:
    """The figures of one run: latency distributions, throughput and (with an SLO) attainment."""
    done = [r for r in records if r.ok]
    per_s = lambda n: n / duration_s if duration_s > 0 else 0.0  # noqa: E731
    summary = {
        "requests": len(records), "completed": len(done), "failed": len(records) - len(done), "duration_s": duration_s,
        "request_throughput": per_s(len(done)), "output_throughput": per_s(sum(r.output_tokens for r in done)),
        "ttft_s": distribution([r.ttft for r in done]),
        "tpot_s": distribution([t for r in done if (t := r.tpot) is not None]),
        "itl_s": distribution([gap for r in done for gap in r.itls]), "e2e_s": distribution([r.e2e for r in done]),
    }  # fmt: skip
    if slo is not None:
        summary |= {"slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}, "attainment": attainment(records, slo)}
    return summary


@dataclass(frozen=True)
class Goodput:
    """``rate`` req/s; ``bound``: 'exact' (the crossing, interpolated between the last passing and
    the first failing rate), 'at_least' (every rate passed) or 'below' (the lowest failed; rate 0)."""

    rate: float
    bound: str

    def __str__(self) -> str:
        return {"at_least": f">= {self.rate:.3g}", "below": "< lowest rate"}.get(self.bound, f"{self.rate:.3g}")


def goodput(points: Sequence[tuple[float, float]], target: float = 0.9) -> Goodput:
    """DistServe's goodput from (rate, attainment) points: the first crossing below ``target``."""
    ordered = sorted(points)
    if not ordered:
        raise ValueError("goodput needs at least one (rate, attainment) point")
    failing = next((i for i, (_, value) in enumerate(ordered) if value < target), None)
    if failing is None:
        return Goodput(ordered[-1][0], "at_least")
    if failing == 0:
        return Goodput(0.0, "below")
    (pass_rate, pass_value), (rate, value) = ordered[failing - 1], ordered[failing]
    return Goodput(pass_rate + (pass_value - target) / (pass_value - value) * (rate - pass_rate), "exact")
