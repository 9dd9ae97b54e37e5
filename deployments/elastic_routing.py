"""The ingress's side of the elastic autoscaler.

It syncs with the controller every ``SYNC_PERIOD_S`` (sending the latencies of the requests
that finished, getting the routing plan back), counts exactly what it has in flight
(``track``: one try of a request, from its start to its end), and picks a route per request
(``autoscaling.routing``: ``LENT``, ``ON_DECODE`` or ``DISAGGREGATED``, by the rules of
``autoscaling.placement``; the simulator routes through the same ``RouteBook``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from autoscaling.messages import IngressReport, LatencySample, RoutingPlan
from autoscaling.policy import Policy
from autoscaling.routing import Route, RouteBook
from deployments.background import keep_running

if TYPE_CHECKING:
    from engine.params import GenerationRequest

__all__ = ["ElasticRouting", "Route", "Tracked"]
logger = logging.getLogger("ray.serve")  # Serve writes it to the replica's log file, INFO included
SYNC_PERIOD_S = 0.25
VIEW_TIMEOUT_S = 10.0


class ElasticRouting:
    def __init__(self, controller: Any, policy: Policy) -> None:
        self.controller, self.policy = controller, policy
        self.plan = RoutingPlan(prefill=1, decode=1, lent=0, decode_kv_usage=None, tpot_p90_s=None)
        self.book = RouteBook(policy)
        self._samples: list[LatencySample] = []  # finished since the last sync
        self._sent_tokens = 0  # the book's admitted prompt tokens at the last sync that went through
        self._name = uuid.uuid4().hex  # this ingress, to the controller
        self._task: asyncio.Task | None = None

    # ---- choosing ------------------------------------------------------------------------

    def route(self, prompt_tokens: int, output_tokens: int) -> Route:
        self._start()
        route = self.book.choose(self.plan, prompt_tokens, output_tokens)
        if route is Route.ON_DECODE:
            logger.debug("prompt of %d tokens prefilled on decode: %s", prompt_tokens, self.book.last_placement.reason)
        return route

    @contextmanager
    def track(self, request: GenerationRequest, route: Route) -> Iterator[Tracked]:
        """One try of ``request`` on ``route``, from its start to its end: counted in flight on
        its route (and its output length on the decode pool), its prompt counted as queued
        until ``Tracked.prefilled`` (a pull's prefill call returned, or its first output)."""
        output_tokens = request.sampling.max_tokens
        tracked = Tracked(self.book, route, len(request.prompt_token_ids))
        self.book.enter(route, tracked.prompt_tokens, output_tokens)
        try:
            yield tracked
        finally:
            tracked.prefilled()
            self.book.leave(route, output_tokens)

    # ---- what was measured -----------------------------------------------------------------

    def observe(self, ttft_s: float | None, tpot_s: float | None, prefill_s: float | None) -> None:
        if ttft_s is not None:
            self._samples.append(LatencySample(ttft_s, tpot_s, prefill_s))

    # ---- the sync with the controller -------------------------------------------------------

    def _start(self) -> None:
        """The sync loop, started by the first request; in a context of its own, so the syncs
        carry no request id of the client request that happened to start it."""
        self._task = keep_running(self._task, self._sync_loop)

    async def _sync_loop(self) -> None:
        """Every ``SYNC_PERIOD_S`` while there is news (finished requests, admitted prompts);
        with none, once per decision interval (the plan changes no more often than that): an
        idle app's calls cost CPU its neighbours could use."""
        synced_at = -math.inf
        while True:
            admitted = self.book.admitted_prompt_tokens
            news = bool(self._samples) or admitted != self._sent_tokens
            if news or time.monotonic() - synced_at >= self.policy.interval_s:
                samples, self._samples = self._samples, []
                report = IngressReport(tuple(samples), admitted - self._sent_tokens, self.book.seconds_per_prompt_token)
                try:
                    self.plan = await self.controller.sync.remote(report, self._name)
                    self._sent_tokens, synced_at = admitted, time.monotonic()
                except Exception as exc:  # the controller restarting: route by the last plan
                    logger.warning("autoscaler sync failed: %s", exc)
                    self._samples = samples + self._samples  # sent with the next sync
            await asyncio.sleep(SYNC_PERIOD_S)

    async def view(self) -> dict[str, Any]:
        """The controller's view (``TimeoutError`` when it does not answer in ``VIEW_TIMEOUT_S``)
        and this ingress's routing state."""
        self._start()
        view = await asyncio.wait_for(self.controller.view.remote(), VIEW_TIMEOUT_S)
        view["ingress"] = {
            "plan": self.plan.__dict__,
            "in_flight": {route.value: n for route, n in self.book.in_flight.items()},
            "routed": {route.value: n for route, n in self.book.routed.items()},
            "prefill_tokens_in_flight": self.book.prefill_tokens,
            "seconds_per_prompt_token": self.book.seconds_per_prompt_token,
        }
        return view


class Tracked:
    """One try of a request as ``ElasticRouting.track`` counts it."""

    def __init__(self, book: RouteBook, route: Route, prompt_tokens: int) -> None:
        self._book, self.route, self.prompt_tokens = book, route, prompt_tokens
        self._queued = True

    def prefilled(self, compute_s: float | None = None) -> None:
        """Its prompt left the prefill queue (once; later calls leave the count alone);
        ``compute_s``, its prefill's compute seconds, feeds the seconds-per-token estimate."""
        if self._queued:
            self._queued = False
            self._book.prefilled(self.route, self.prompt_tokens)
        if compute_s is not None:
            self._book.prefill_speed(self.prompt_tokens, compute_s)
