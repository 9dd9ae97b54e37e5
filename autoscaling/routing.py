"""The ingress's routing under the elastic autoscaler, as plain objects: the plan the controller
hands out (``routing_plan``) and the ingress's exact counts with the route they choose
(``RouteBook``). The served ingress (``deployments.elastic_routing``) and the simulator
(``planner.sim_elastic``) both route through these, so a simulation follows the served rules.

* ``LENT``: the whole request on a lent prefill replica (role ``both``);
* ``ON_DECODE``: prefilled on a decode replica, because the prefill queue would break the
  TTFT SLO and the decode side has room (``autoscaling.placement.place_prompt``);
* ``DISAGGREGATED``: prefill, then decode, as without the autoscaler.
"""

from __future__ import annotations

from collections import Counter, deque
from enum import StrEnum

from autoscaling.decide import ControllerState
from autoscaling.messages import RoutingPlan
from autoscaling.placement import Placement, PromptLoad, decode_heavy, place_prompt, prefer_lent
from autoscaling.policy import Policy
from autoscaling.snapshot import Snapshot
from engine.params import Role

SPEED_SAMPLES = 32  # prefills the seconds-per-token estimate looks back on


class Route(StrEnum):
    DISAGGREGATED = "disaggregated"
    LENT = "lent"
    ON_DECODE = "on_decode"


def routing_plan(snapshot: Snapshot, state: ControllerState) -> RoutingPlan:
    """The plan the ingress routes by, from the replicas' reports and the lending state."""
    decode = [r for r in snapshot.replicas if r.home is Role.DECODE]
    blocks = sum(r.total_blocks for r in decode)
    return RoutingPlan(
        prefill=sum(r.serves_prefill for r in snapshot.replicas),
        decode=len(decode),
        lent=sum(r.replica in state.lent and r.role is Role.BOTH for r in snapshot.replicas),
        decode_kv_usage=sum(r.decode_blocks for r in decode) / blocks if blocks else None,
        tpot_p90_s=snapshot.observed.tpot_p90_s,
    )


class RouteBook:
    """What one ingress has in flight, counted exactly (not sampled), and the route it picks.

    A request is ``enter``-ed on its route and ``leave``-s it at its end; its prompt counts as
    queued at the prefill pool (or on decode, for ``ON_DECODE``) until ``prefilled``."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.seconds_per_prompt_token: float | None = None
        self.prefill_tokens = 0  # prompt tokens of disaggregated requests before their first token
        self.prompts_on_decode = 0  # prompts prefilling on decode replicas
        self.in_flight = dict.fromkeys(Route, 0)
        self.routed = dict.fromkeys(Route, 0)  # requests per route since start
        self.decoding: Counter[int] = Counter()  # output lengths of requests on the decode pool
        self.admitted_prompt_tokens = 0  # since start, every route: the prefill pool's arrivals
        self._speeds: deque[float] = deque(maxlen=SPEED_SAMPLES)
        self.last_placement: Placement | None = None  # why the last prompt went where it went

    def choose(self, plan: RoutingPlan, prompt_tokens: int, output_tokens: int) -> Route:
        decode_in_flight = self.in_flight[Route.DISAGGREGATED] + self.in_flight[Route.ON_DECODE]
        lent_has_room = prefer_lent(decode_in_flight, plan.decode, self.in_flight[Route.LENT], plan.lent)
        if lent_has_room and decode_heavy(prompt_tokens, output_tokens):
            return Route.LENT
        load = PromptLoad(
            prompt_tokens=prompt_tokens,
            prefill_tokens_in_flight=self.prefill_tokens,
            prefill_replicas=plan.prefill,
            decode_prompts_in_flight=self.prompts_on_decode,
            decode_replicas=plan.decode,
            seconds_per_prompt_token=self.seconds_per_prompt_token,
            tpot_p90_s=plan.tpot_p90_s,
            decode_kv_usage=plan.decode_kv_usage,
            decode_min_output_tokens=min(self.decoding) if self.decoding else None,
        )
        self.last_placement = place_prompt(load, self.policy)
        return Route.ON_DECODE if self.last_placement.on_decode else Route.DISAGGREGATED

    def enter(self, route: Route, prompt_tokens: int, output_tokens: int) -> None:
        self.in_flight[route] += 1
        self.routed[route] += 1
        self.admitted_prompt_tokens += prompt_tokens
        if route is not Route.LENT:
            self.decoding[output_tokens] += 1
        self._queue(route, prompt_tokens, +1)

    def prefilled(self, route: Route, prompt_tokens: int, compute_s: float | None = None) -> None:
        """The prompt left its queue (call once per ``enter``); ``compute_s``: its prefill's
        compute seconds, for the seconds-per-token estimate."""
        self._queue(route, prompt_tokens, -1)
        if compute_s is not None:
            self.prefill_speed(prompt_tokens, compute_s)

    def leave(self, route: Route, output_tokens: int) -> None:
        self.in_flight[route] -= 1
        if route is not Route.LENT:
            self.decoding[output_tokens] -= 1
            if not self.decoding[output_tokens]:
                del self.decoding[output_tokens]

    def prefill_speed(self, prompt_tokens: int, compute_s: float) -> None:
        """Seconds per prompt token: the least of the last ``SPEED_SAMPLES`` prefills. A prompt
        batched with others reports the whole step's compute, so an average would count the
        same tokens several times; the least is a prompt that ran (nearly) alone."""
        if prompt_tokens <= 0 or compute_s <= 0:
            return
        self._speeds.append(compute_s / prompt_tokens)
        self.seconds_per_prompt_token = min(self._speeds)

    def _queue(self, route: Route, prompt_tokens: int, sign: int) -> None:
        if route is Route.DISAGGREGATED:
            self.prefill_tokens += sign * prompt_tokens
        elif route is Route.ON_DECODE:
            self.prompts_on_decode += sign
