"""Fault injection for failure rehearsals and tests; nothing is injected by default.

A fault is a rule: at a named **point**, an **action**, for the requests it selects.

Points on the transport: ``export`` (producer, pull), ``fetch`` (consumer, before the READ
is posted), ``push_layer`` (producer, per layer; a rule may name one ``layer``),
``finish_push`` (producer, before the completion notice), ``release`` (consumer, the pull's
release notice). Points on a replica (``deployments.server``): ``prefill`` (a prefill call
arrives), ``after_export`` (just after a pull's handle went back), ``after_push`` (a push
completed, its call's reply not sent yet: the crash comes 2 s later, time for the decode
replica to start streaming; ``deployments.server.AFTER_PUSH_CRASH_S``),
``mid_decode`` (a decode stream has sent ``after_tokens`` tokens).

Actions: ``delay`` (wait ``seconds`` there, or until ``cut_delays``), ``fail`` (raise ``KVTransferError``), ``drop``
(``release`` only: the notice is not sent, so the producer frees the blocks when
``kv_transfer_timeout_s`` runs out), ``crash`` (the replica's process ends at once, as a
``kill -9`` would). Selection: ``probability`` decides once per request (a seeded hash of
the rule and the request id, so a request meets a rule's fault at all its points or at none:
"5% of transfers fail", not 5% of layers), ``request_id_prefix`` limits a rule to requests
whose id starts with it (rehearse on a live service with your own requests), and a crash
happens at most ``max_times`` times (counted across restarts by the ``crash_gate`` the
replica gives).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.params import client_request_id
from kv_transport.base import KVTransferError

logger = logging.getLogger(__name__)

TRANSPORT_POINTS = ("export", "fetch", "push_layer", "finish_push")
REPLICA_POINTS = ("prefill", "after_export", "after_push", "mid_decode")
FaultPoint = Literal[
    "export", "fetch", "push_layer", "finish_push", "release", "prefill", "after_export", "after_push", "mid_decode"
]
FaultAction = Literal["delay", "fail", "drop", "crash"]


class FaultRule(BaseModel):
    """One fault: ``faults`` in the application's config is a list of these."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    point: FaultPoint = Field(description="where: a transport point or a replica point (module docstring)")
    action: FaultAction = Field(description="delay, fail, drop (release only) or crash")
    seconds: float = Field(0.0, ge=0, le=3600, description="delay: how long")
    probability: float = Field(1.0, ge=0, le=1, description="share of requests the rule selects")
    request_id_prefix: str | None = Field(None, min_length=1, description="only requests whose id starts with it")
    layer: int | None = Field(None, ge=0, description="push_layer: only this layer")
    after_tokens: int = Field(2, ge=1, description="mid_decode: tokens sent before the crash")
    max_times: int | None = Field(1, ge=1, description="crash: at most this many times (None: unbounded)")

    @model_validator(mode="after")
    def _check(self) -> FaultRule:
        if self.action == "drop" and self.point != "release":
            raise ValueError(f"action 'drop' applies to point 'release' only, not {self.point!r}")
        if self.point == "release" and self.action not in ("drop", "crash"):
            raise ValueError(f"point 'release' takes action 'drop' or 'crash', not {self.action!r}")
        if self.action in ("delay", "fail") and self.point not in TRANSPORT_POINTS:
            raise ValueError(
                f"action {self.action!r} applies to transport points only {TRANSPORT_POINTS}, not {self.point!r}"
            )
        if self.action == "delay" and self.seconds <= 0:
            raise ValueError("action 'delay' needs seconds > 0")
        if self.layer is not None and self.point != "push_layer":
            raise ValueError("layer applies to point 'push_layer' only")
        return self


CrashGate = Callable[[int, FaultRule], bool]
"""``gate(rule index, rule)``: may this crash happen (its ``max_times`` not used up)?"""


def crash_now(point: str, request_id: str) -> None:
    """End this process as ``kill -9`` would (no cleanup, no exit handlers)."""
    logger.error("fault injection: crashing this replica at %s (request %s)", point, request_id)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class FaultPoints:
    """The rules in force in one process; ``NO_FAULTS`` (no rules) costs one check per point."""

    def __init__(self, rules: Sequence[FaultRule] = (), seed: int = 0, crash_gate: CrashGate | None = None) -> None:
        self.rules = tuple(rules)
        self.seed = seed
        self.crash_gate = crash_gate
        self._cut = threading.Event()  # set: delays end (on threads: ``hit``)
        self._waking: set[asyncio.Future] = set()  # the delays in progress on event loops (``hit_async``)

    def cut_delays(self) -> None:
        """End the delays in progress and any later one: for an actor whose rules are replaced
        (a test holds a transfer until it has set the scene). Safe from any thread."""
        self._cut.set()
        for waking in list(self._waking):
            waking.get_loop().call_soon_threadsafe(_wake, waking)

    @classmethod
    def of(
        cls, delay_s: dict[str, float] | None = None, fail: Sequence[str] = (), drop_release: bool = False
    ) -> FaultPoints:
        """Rules for every request: delays, failures, dropped release notices (benchmarks, tests)."""
        rules = [FaultRule(point=p, action="delay", seconds=s) for p, s in (delay_s or {}).items()]
        rules += [FaultRule(point=p, action="fail") for p in fail]
        if drop_release:
            rules.append(FaultRule(point="release", action="drop"))
        return cls(rules)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def selected(self, point: str, request_id: str, layer: int | None = None) -> list[tuple[int, FaultRule]]:
        """The rules that apply at ``point`` to this request (and layer)."""
        return [
            (index, rule)
            for index, rule in enumerate(self.rules)
            if rule.point == point
            and (rule.layer is None or rule.layer == layer)
            and (rule.request_id_prefix is None or request_id.startswith(rule.request_id_prefix))
            and self._drawn(index, rule, request_id)
        ]

    def _drawn(self, index: int, rule: FaultRule, request_id: str) -> bool:
        if rule.probability >= 1:
            return True
        drawn_for = client_request_id(request_id)  # the same draw for the same client id, run after run
        digest = hashlib.blake2b(f"{self.seed}/{index}/{drawn_for}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64 < rule.probability

    def hit(self, point: str, request_id: str, peer: str, layer: int | None = None) -> None:
        """Apply the faults at ``point`` (a delay blocks: for the engine thread)."""
        for index, rule in self.selected(point, request_id, layer):
            if rule.action == "delay":
                self._cut.wait(rule.seconds)
            self._act(index, rule, point, request_id, peer)

    async def hit_async(self, point: str, request_id: str, peer: str) -> None:
        for index, rule in self.selected(point, request_id):
            if rule.action == "delay":
                await self._delay(rule.seconds)
            self._act(index, rule, point, request_id, peer)

    async def _delay(self, seconds: float) -> None:
        waking = asyncio.get_running_loop().create_future()
        self._waking.add(waking)
        if self._cut.is_set():  # cut before, or while it was being added
            _wake(waking)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waking, seconds)
        finally:
            self._waking.discard(waking)

    def drops(self, point: str, request_id: str) -> bool:
        """Whether a notice at ``point`` is to be left out for this request (crashing first if asked)."""
        dropped = False
        for index, rule in self.selected(point, request_id):
            self._act(index, rule, point, request_id, "")
            dropped = dropped or rule.action == "drop"
        return dropped

    def crash_due(self, point: str, request_id: str) -> bool:
        """Whether a crash at ``point`` selects this request and may still happen (its slot
        under ``max_times`` is then taken): for a caller that crashes a moment later."""
        rules = self.selected(point, request_id)
        return any(rule.action == "crash" and self._granted(index, rule) for index, rule in rules)

    def _granted(self, index: int, rule: FaultRule) -> bool:
        return self.crash_gate is None or self.crash_gate(index, rule)

    def _act(self, index: int, rule: FaultRule, point: str, request_id: str, peer: str) -> None:
        if rule.action == "fail":
            raise KVTransferError(f"injected failure at {point}", request_id, peer)
        if rule.action == "crash" and self._granted(index, rule):
            crash_now(point, request_id)


def _wake(waking: asyncio.Future) -> None:
    if not waking.done():
        waking.set_result(None)


NO_FAULTS = FaultPoints()
