"""The ingress's side of the elastic autoscaler.

It syncs with the controller every ``SYNC_PERIOD_S`` (sending the latencies of the requests
that finished, getting the routing plan back), counts exactly what it has in flight
(``track``: one try of a request, from its start to its end), and picks a route per
request (``autoscaling.placement``'s rules):

* ``LENT``: the whole request on a lent prefill replica (role ``both``), through the prefill
  deployment's handle (its role-aware router picks a replica in the decode or both role);
* ``ON_DECODE``: prefilled on a decode replica, because the prefill queue would break the
  TTFT SLO and the decode side has room;
* ``DISAGGREGATED``: prefill, then decode (pull or push), as without the autoscaler.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from autoscaling.messages import LatencySample, RoutingPlan
from autoscaling.placement import PromptLoad, decode_heavy, place_prompt, prefer_lent
from autoscaling.policy import Policy
from deployments.background import keep_running

if TYPE_CHECKING:
    from engine.params import GenerationRequest

logger = logging.getLogger("ray.serve")  # Serve writes it to the replica's log file, INFO included
SYNC_PERIOD_S = 0.25
VIEW_TIMEOUT_S = 10.0
SPEED_SAMPLES = 32  # prefills the seconds-per-token estimate looks back on


class Route(StrEnum):
    DISAGGREGATED = "disaggregated"
    LENT = "lent"
    ON_DECODE = "on_decode"


class ElasticRouting:
    def __init__(self, controller: Any, policy: Policy) -> None:
        self.controller, self.policy = controller, policy
        self.plan = RoutingPlan(prefill=1, decode=1, lent=0, decode_kv_usage=None, tpot_p90_s=None)
        self.seconds_per_prompt_token: float | None = None
        self._samples: list[LatencySample] = []  # finished since the last sync
        self._prefill_tokens = 0  # prompt tokens of disaggregated requests before their first token
        self._prompts_on_decode = 0  # prompts prefilling on decode replicas
        self._in_flight = {Route.DISAGGREGATED: 0, Route.LENT: 0, Route.ON_DECODE: 0}
        self._routed = dict.fromkeys(Route, 0)  # requests per route since start
        self._decoding: Counter[int] = Counter()  # output lengths of requests on the decode pool
        self._speeds: deque[float] = deque(maxlen=SPEED_SAMPLES)
        self._task: asyncio.Task | None = None

    # ---- choosing ------------------------------------------------------------------------

    def route(self, prompt_tokens: int, output_tokens: int) -> Route:
        self._start()
        plan = self.plan
        decode_in_flight = self._in_flight[Route.DISAGGREGATED] + self._in_flight[Route.ON_DECODE]
        lent_has_room = prefer_lent(decode_in_flight, plan.decode, self._in_flight[Route.LENT], plan.lent)
        if lent_has_room and decode_heavy(prompt_tokens, output_tokens):
            return Route.LENT
        load = PromptLoad(
            prompt_tokens=prompt_tokens,
            prefill_tokens_in_flight=self._prefill_tokens,
            prefill_replicas=plan.prefill,
            decode_prompts_in_flight=self._prompts_on_decode,
            decode_replicas=plan.decode,
            seconds_per_prompt_token=self.seconds_per_prompt_token,
            tpot_p90_s=plan.tpot_p90_s,
            decode_kv_usage=plan.decode_kv_usage,
            decode_min_output_tokens=min(self._decoding) if self._decoding else None,
        )
        placement = place_prompt(load, self.policy)
        if placement.on_decode:
            logger.debug("prompt of %d tokens prefilled on decode: %s", prompt_tokens, placement.reason)
            return Route.ON_DECODE
        return Route.DISAGGREGATED

    @contextmanager
    def track(self, request: GenerationRequest, route: Route) -> Iterator[Tracked]:
        """One try of ``request`` on ``route``, from its start to its end: counted in flight on
        its route (and its output length on the decode pool), its prompt counted as queued
        until ``Tracked.prefilled`` (a pull's prefill call returned, or its first output)."""
        output_tokens = request.sampling.max_tokens
        on_decode_pool = route is not Route.LENT
        self._in_flight[route] += 1
        self._routed[route] += 1
        if on_decode_pool:
            self._decoding[output_tokens] += 1
        tracked = Tracked(self, route, len(request.prompt_token_ids))
        self._queue(route, tracked.prompt_tokens, +1)
        try:
            yield tracked
        finally:
            tracked.prefilled()
            self._in_flight[route] -= 1
            if on_decode_pool:
                self._decoding[output_tokens] -= 1
                if not self._decoding[output_tokens]:
                    del self._decoding[output_tokens]

    def _queue(self, route: Route, prompt_tokens: int, sign: int) -> None:
        """A prompt enters (+1) or leaves (-1) the prefill queue of its route."""
        if route is Route.DISAGGREGATED:
            self._prefill_tokens += sign * prompt_tokens
        elif route is Route.ON_DECODE:
            self._prompts_on_decode += sign

    # ---- what was measured -----------------------------------------------------------------

    def _prefill_speed(self, prompt_tokens: int, compute_s: float) -> None:
        """Seconds per prompt token: the least of the last ``SPEED_SAMPLES`` prefills. A prompt
        batched with others reports the whole step's compute, so an average would count the
        same tokens several times; the least is a prompt that ran (nearly) alone."""
        if prompt_tokens <= 0 or compute_s <= 0:
            return
        self._speeds.append(compute_s / prompt_tokens)
        self.seconds_per_prompt_token = min(self._speeds)

    def observe(self, ttft_s: float | None, tpot_s: float | None, prefill_s: float | None) -> None:
        if ttft_s is not None:
            self._samples.append(LatencySample(ttft_s, tpot_s, prefill_s))

    # ---- the sync with the controller -------------------------------------------------------

    def _start(self) -> None:
        """The sync loop, started by the first request; in a context of its own, so the syncs
        carry no request id of the client request that happened to start it."""
        self._task = keep_running(self._task, self._sync_loop)

    async def _sync_loop(self) -> None:
        while True:
            samples, self._samples = self._samples, []
            try:
                self.plan = await self.controller.sync.remote(samples)
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
            "in_flight": {route.value: n for route, n in self._in_flight.items()},
            "routed": {route.value: n for route, n in self._routed.items()},
            "prefill_tokens_in_flight": self._prefill_tokens,
            "seconds_per_prompt_token": self.seconds_per_prompt_token,
        }
        return view


class Tracked:
    """One try of a request as ``ElasticRouting.track`` counts it."""

    def __init__(self, routing: ElasticRouting, route: Route, prompt_tokens: int) -> None:
        self._routing, self.route, self.prompt_tokens = routing, route, prompt_tokens
        self._queued = True

    def prefilled(self, compute_s: float | None = None) -> None:
        """Its prompt left the prefill queue (once; later calls leave the count alone);
        ``compute_s``, its prefill's compute seconds, feeds the seconds-per-token estimate."""
        if self._queued:
            self._queued = False
            self._routing._queue(self.route, self.prompt_tokens, -1)
        if compute_s is not None:
            self._routing._prefill_speed(self.prompt_tokens, compute_s)
