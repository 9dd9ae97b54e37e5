"""The event loop and the replica model behind ``planner.simulator.simulate``.

Events live on one heap ``(time, sequence number, kind, object, version)``; arrivals are read
from the sorted request list instead of the heap. A replica's work between two changes of its
batch is planned at once: a *decode segment* of up to ``SEGMENT_STEPS`` steps, each timed with
``decode_step_s(batch, context)`` as the context grows by the batch every step, ends at the
earliest step a running request finishes. Something new for the replica (a prompt, a pulled
KV, a role change) cuts the segment at the next step boundary. So the cost of a run is
O(events log events) with events ~ requests + batch changes, not one per token.

Step counting: ``steps`` counts the engine steps in which the running requests decode. A
request that joins with ``steps == s`` (its first token out) finishes after step
``s + output_tokens - 1``; while it runs its KV length is prompt + tokens so far, so
``ctx`` (the batch's sum of KV lengths) grows by the batch each step.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from autoscaling.routing import RouteBook
from planner.costs import CostModel
from planner.sim_types import PoolSample, SimDecision, SimRecord, SimRequest, SimResult, SystemSpec

SEGMENT_STEPS = (4, 64)  # decode steps planned at once: from 4, doubling while no cut comes, up to 64
STEP_END, XFER_DONE, TICK, START = 0, 1, 2, 3
PREFILL, DECODE, BOTH = "prefill", "decode", "both"


def mixed_step_s(cost: CostModel, batch: int, context_tokens: int, prompt_tokens: int) -> float:
    """One engine step running ``batch`` decodes and ``prompt_tokens`` prompt tokens.

    One forward runs all rows, so the matrix products cost what a prefill of
    ``prompt_tokens + batch`` rows costs; the decodes' attention over their KV
    (``decode_step_s(batch, ctx) - decode_step_s(batch, 0)``) comes on top. Never less than
    the decode step alone."""
    if prompt_tokens <= 0:
        return cost.decode_step_s(batch, context_tokens)
    if batch <= 0:
        return cost.prefill_s(prompt_tokens)
    decode = cost.decode_step_s(batch, context_tokens)
    attention = decode - cost.decode_step_s(batch, 0)
    return max(cost.prefill_s(prompt_tokens + batch) + attention, decode)


class Req:
    """One request in flight. ``whole``: it decodes where its prompt runs (colocated, lent)."""

    __slots__ = (
        "index", "arrival", "prompt", "output", "whole", "first_s", "done_s", "prefill_s", "left", "home", "route",
    )  # fmt: skip

    def __init__(self, index: int, request: SimRequest) -> None:
        self.index, self.arrival = index, request.arrival_s
        self.prompt, self.output = request.prompt_tokens, request.output_tokens
        self.whole, self.first_s, self.done_s, self.prefill_s = False, 0.0, 0.0, None
        self.left = self.prompt  # prompt tokens not computed yet
        self.home: Replica | None = None  # where it decodes
        self.route = None  # elastic: its ``autoscaling.routing.Route``


class Replica:
    """One engine replica: its queues, its running batch and the step in progress."""

    __slots__ = (
        "index", "role", "home", "cost", "queue", "prefilling", "joining", "kv_wait", "num_running", "ctx",
        "steps", "finishes", "kv_used", "busy", "starting", "bounds", "chunks", "version", "in_flight",
        "queued_tokens", "segment_steps", "prompts_only", "token_rate",
    )  # fmt: skip

    def __init__(self, index: int, role: str, cost: CostModel) -> None:
        self.index, self.role, self.home, self.cost = index, role, role, cost
        self.queue: deque[Req] = deque()  # prompts not admitted yet
        self.prefilling: list[Req] = []  # admitted prompts with tokens left (chunked prefill)
        self.joining: list[Req] = []  # KV in place, joining the batch at the next boundary
        self.kv_wait: deque[Req] = deque()  # waiting for KV room (decode side of a pull)
        self.num_running, self.ctx, self.steps = 0, 0, 0
        self.finishes: list[tuple[int, int, Req]] = []  # heap of (finish step, index, request)
        self.kv_used = 0
        self.busy = False
        self.starting = False  # a START event is on the heap
        self.bounds: list[float] = []  # end times of the planned steps
        self.chunks: list[tuple[Req, int]] = []  # prompt work of the step in progress
        self.version = 0  # bumps when the planned end changes (stale heap entries are skipped)
        self.in_flight = 0  # requests routed here and not done with it (the router's load)
        self.queued_tokens = 0  # prompt tokens queued or prefilling here
        self.segment_steps = SEGMENT_STEPS[0]  # the next decode segment's length at most
        self.prompts_only = False  # the step in progress runs prompts alone (prefill-first scheduler)
        self.token_rate = 0.0  # tokens/s its step in progress streams (the serving stack's CPU load)

    @property
    def decoding(self) -> int:
        return self.num_running + len(self.joining) + len(self.kv_wait)


class Lending(Protocol):
    """The autoscaler inside a run (``planner.sim_elastic.Elastic``): the loop calls ``tick``
    every ``interval_s``, asks ``route`` for each arriving request (a replica that runs it
    whole, or None: the disaggregated path), and tells ``prefilled`` and ``finished``."""

    interval_s: float
    book: RouteBook
    decisions: list[SimDecision]
    timeline: list[PoolSample]

    def tick(self, now: float) -> None: ...

    def route(self, req: Req) -> Replica | None: ...

    def prefilled(self, req: Req) -> None: ...

    def finished(self, req: Req, now: float) -> None: ...

    def replica_seconds(self, end_s: float) -> dict[str, float]: ...


class Simulation:
    """One run of ``SystemSpec`` over a list of requests."""

    def __init__(self, system: SystemSpec, requests: Sequence[SimRequest]) -> None:
        self.system = system
        ordered = sorted(requests, key=lambda r: r.arrival_s)
        self.requests = [Req(i, r) for i, r in enumerate(ordered)]
        self.heap: list[tuple[float, int, int, object, int]] = []
        self.seq = itertools.count()
        self.rng = random.Random(0)
        self.num_busy, self.num_done = 0, 0
        self.token_rate = 0.0  # tokens/s all replicas' steps in progress stream
        self.records: list[SimRecord | None] = [None] * len(ordered)
        if system.kind == "colocated":
            self.prefill = [Replica(i, BOTH, system.prefill_cost) for i in range(system.prefill_replicas)]
            self.decode: list[Replica] = []
        else:
            self.prefill = [Replica(i, PREFILL, system.prefill_cost) for i in range(system.prefill_replicas)]
            offset = system.prefill_replicas
            self.decode = [Replica(offset + i, DECODE, system.decode_cost) for i in range(system.decode_replicas)]
        self.elastic: Lending | None = None  # attached by ``simulate`` (``planner.sim_elastic.Elastic``)

    # ---- the loop -----------------------------------------------------------------------

    def run(self) -> SimResult:
        system = self.system
        if not self.prefill or (system.kind == "disaggregated" and not self.decode):
            raise ValueError("a system needs at least one replica in each pool")
        longest = max((r.prompt for r in self.requests), default=0)
        if not system.chunked_prefill and longest > system.max_num_batched_tokens:
            raise ValueError(
                f"a {longest}-token prompt exceeds max_num_batched_tokens={system.max_num_batched_tokens}"
                " without chunked prefill (the engine refuses that configuration)"
            )
        if self.elastic is not None:
            self.push(self.elastic.interval_s, TICK, None, 0)
        next_arrival, requests, heap = 0, self.requests, self.heap
        while True:
            arrival_s = requests[next_arrival].arrival if next_arrival < len(requests) else None
            if heap and (arrival_s is None or heap[0][0] < arrival_s):
                now, _, kind, obj, version = heapq.heappop(heap)
                self.handle(now, kind, obj, version)
            elif arrival_s is not None:
                self.arrive(requests[next_arrival], arrival_s)
                next_arrival += 1
            else:
                break
        if self.num_done < len(requests):
            raise RuntimeError(f"simulation stalled: {len(requests) - self.num_done} requests never finished")
        records = tuple(r for r in self.records if r is not None)
        end_s = max((r.arrival_s + r.e2e_s - system.stack.ttft_s for r in records), default=0.0)
        if self.elastic is None:
            pools = {"colocated": len(self.prefill)} if system.kind == "colocated" else {}
            pools = pools or {"prefill": len(self.prefill), "decode": len(self.decode)}
            return SimResult(records, replica_seconds={pool: n * end_s for pool, n in pools.items()})
        elastic = self.elastic
        routes = {route.value: n for route, n in elastic.book.routed.items()}
        timeline, seconds = tuple(elastic.timeline), elastic.replica_seconds(end_s)
        return SimResult(records, tuple(elastic.decisions), timeline, seconds, routes)

    def push(self, time_s: float, kind: int, obj: object, version: int) -> None:
        heapq.heappush(self.heap, (time_s, next(self.seq), kind, obj, version))

    def handle(self, now: float, kind: int, obj, version: int) -> None:
        if kind == STEP_END:
            if version == obj.version:
                self.step_end(obj, now)
        elif kind == START:
            obj.starting = False
            self.start(obj, now)
        elif kind == XFER_DONE:
            replica = obj.home
            replica.joining.append(obj)
            self.wake(replica, now)
        elif self.num_done < len(self.requests):  # TICK
            self.elastic.tick(now)
            self.push(now + self.elastic.interval_s, TICK, None, 0)

    # ---- routing ------------------------------------------------------------------------

    def pick(self, replicas: list[Replica]) -> Replica:
        """The less loaded of two random replicas (every one when two or fewer), as Serve's router."""
        if len(replicas) <= 2:
            return min(replicas, key=lambda r: (r.in_flight, r.index))
        a, b = self.rng.sample(replicas, 2)
        return a if (a.in_flight, a.index) <= (b.in_flight, b.index) else b

    def arrive(self, req: Req, now: float) -> None:
        whole_on = self.elastic.route(req) if self.elastic is not None else None
        if whole_on is not None or self.system.kind == "colocated":
            req.whole = True
            replica = whole_on or self.pick(self.prefill)
            req.home = replica
        else:
            replica = self.pick(self.prefill)
        replica.in_flight += 1
        replica.queue.append(req)
        replica.queued_tokens += req.prompt
        self.wake(replica, now)

    def to_decode(self, req: Req, now: float) -> None:
        """A prefilled request of the disaggregated path: reserve KV on a decode replica, pull."""
        replica = self.pick(self.decode)
        req.home = replica
        replica.in_flight += 1
        if replica.kv_wait or not self.reserve(replica, req, now):
            replica.kv_wait.append(req)

    def reserve(self, replica: Replica, req: Req, now: float) -> bool:
        need = req.prompt + req.output
        if replica.kv_used + need > replica.cost.kv_capacity_tokens and replica.kv_used > 0:
            return False
        replica.kv_used += need
        transfer = self.system.prefill_cost.transfer_s(req.prompt * self.system.prefill_cost.kv_bytes_per_token)
        self.push(now + transfer, XFER_DONE, req, 0)
        return True

    # ---- records --------------------------------------------------------------------------

    def first_token(self, req: Req, now: float) -> None:
        req.first_s = now
        if req.output <= 1:
            self.done(req, now)

    def done(self, req: Req, now: float) -> None:
        req.done_s = now
        hops = self.system.stack.ttft_s  # the serving stack's fixed share, in front of the first token
        ttft = req.first_s - req.arrival + hops
        tpot = (now - req.first_s) / (req.output - 1) if req.output > 1 else None
        self.records[req.index] = SimRecord(req.prompt, req.output, req.arrival, ttft, tpot, now - req.arrival + hops)
        self.num_done += 1
        if self.elastic is not None:
            self.elastic.finished(req, now)

    # ---- one replica's steps --------------------------------------------------------------

    def wake(self, replica: Replica, now: float) -> None:
        """New work for ``replica``: start a step now (after everything else due now, so
        simultaneous arrivals share the step), or cut its decode segment short."""
        if not replica.busy:
            if not replica.starting:
                replica.starting = True
                self.push(now, START, replica, 0)
            return
        bounds = replica.bounds
        if len(bounds) > 1:
            i = bisect.bisect_left(bounds, now)
            if i < len(bounds) - 1:
                del bounds[i + 1 :]
                replica.segment_steps = SEGMENT_STEPS[0]
                replica.version += 1
                self.push(bounds[-1], STEP_END, replica, replica.version)

    def start(self, replica: Replica, now: float) -> None:
        """At a step boundary of an idle replica: admit joiners, then plan the next step."""
        for req in replica.joining:
            self.join(replica, req, now)
        replica.joining.clear()
        chunks, prompt_tokens = self.plan_prompts(replica)
        if not chunks and replica.num_running == 0:
            self.set_token_rate(replica, 0.0)
            return
        replica.busy, replica.chunks = True, chunks
        replica.prompts_only = bool(chunks) and self.system.prefill_first
        decodes = 0 if replica.prompts_only else replica.num_running
        stack = self.system.stack
        if chunks:
            step_s = mixed_step_s(replica.cost, decodes, replica.ctx if decodes else 0, prompt_tokens)
            served = stack.prefill_factor
        else:
            step_s = replica.cost.decode_step_s(decodes, replica.ctx)
            served = stack.decode_factor_at(decodes)
        self.set_token_rate(replica, decodes / (step_s * served))
        factor = self.slowdown() * served
        self.num_busy += 1
        if chunks:
            replica.bounds = [now + step_s * factor]
        else:
            replica.bounds = self.decode_segment(replica, now, factor)
        replica.version += 1
        self.push(replica.bounds[-1], STEP_END, replica, replica.version)

    def set_token_rate(self, replica: Replica, rate: float) -> None:
        self.token_rate += rate - replica.token_rate
        replica.token_rate = rate

    def slowdown(self) -> float:
        """The factor on a step starting now: the interference of another busy replica, times
        the cores' over-subscription by the busy replicas and the serving stack's CPU demand
        (processor sharing; ``ServingStack.cpu_s_per_token`` and ``cores``)."""
        factor = 1.0 + self.system.interference if self.num_busy > 0 else 1.0
        stack = self.system.stack
        if stack.cores and stack.cpu_s_per_token:
            demand = self.num_busy + 1 + stack.cpu_s_per_token * self.token_rate
            factor *= max(1.0, demand / stack.cores)
        return factor

    def decode_segment(self, replica: Replica, now: float, factor: float) -> list[float]:
        steps = min(replica.finishes[0][0] - replica.steps, replica.segment_steps)
        batch, ctx, step_s, bounds, t = replica.num_running, replica.ctx, replica.cost.decode_step_s, [], now
        if getattr(replica.cost, "constant_decode_step", False):  # the same sums, without a call per step
            return list(itertools.accumulate(itertools.repeat(step_s(batch, ctx) * factor, steps), initial=now))[1:]
        for j in range(steps):
            t += step_s(batch, ctx + j * batch) * factor
            bounds.append(t)
        return bounds

    def plan_prompts(self, replica: Replica) -> tuple[list[tuple[Req, int]], int]:
        """The engine scheduler's admission: decodes first (one token each), then prompts
        already prefilling, then waiting ones in FIFO order within the token budget,
        ``max_num_seqs`` and (for requests decoding here) the KV pool."""
        system = self.system
        budget = system.max_num_batched_tokens - (0 if system.prefill_first else replica.num_running)
        chunked = system.chunked_prefill
        chunks: list[tuple[Req, int]] = []
        for req in replica.prefilling:
            if budget <= 0:
                break
            n = min(req.left, budget)
            chunks.append((req, n))
            budget -= n
        seats = system.max_num_seqs - replica.num_running - len(replica.prefilling)
        capacity = replica.cost.kv_capacity_tokens
        while replica.queue and budget > 0 and seats > 0:
            req = replica.queue[0]
            n = min(req.left, budget) if chunked else req.left
            need = req.prompt + req.output if req.whole else 0
            if n > budget or (need and replica.kv_used + need > capacity and replica.kv_used > 0):
                break
            replica.queue.popleft()
            replica.kv_used += need
            replica.prefilling.append(req)
            chunks.append((req, n))
            budget -= n
            seats -= 1
        return chunks, sum(n for _, n in chunks)

    def step_end(self, replica: Replica, now: float) -> None:
        replica.busy = False
        if len(replica.bounds) == replica.segment_steps:  # a whole segment ran uncut: plan longer ones
            replica.segment_steps = min(2 * replica.segment_steps, SEGMENT_STEPS[1])
        self.num_busy -= 1
        if replica.num_running and not replica.prompts_only:
            self.advance(replica, len(replica.bounds), now)
        if replica.chunks:
            self.prompts_done(replica, now)
        replica.bounds = []
        self.start(replica, now)

    def advance(self, replica: Replica, steps: int, now: float) -> None:
        replica.steps += steps
        replica.ctx += steps * replica.num_running
        finishes = replica.finishes
        while finishes and finishes[0][0] <= replica.steps:
            _, _, req = heapq.heappop(finishes)
            replica.num_running -= 1
            replica.ctx -= req.prompt + req.output
            replica.kv_used -= req.prompt + req.output
            replica.in_flight -= 1
            self.done(req, now)
        while replica.kv_wait and self.reserve(replica, replica.kv_wait[0], now):
            replica.kv_wait.popleft()

    def prompts_done(self, replica: Replica, now: float) -> None:
        for req, n in replica.chunks:
            req.left -= n
            replica.queued_tokens -= n
            if req.left > 0:
                continue
            replica.prefilling.remove(req)
            req.prefill_s = now - req.arrival
            if self.elastic is not None:
                self.elastic.prefilled(req)
            if req.whole:
                if req.output <= 1:
                    replica.kv_used -= req.prompt + req.output
                    replica.in_flight -= 1
                self.join(replica, req, now)
            else:
                replica.in_flight -= 1
                self.first_token(req, now) if req.output <= 1 else self.to_decode(req, now)
        replica.chunks = []

    def join(self, replica: Replica, req: Req, now: float) -> None:
        """``req``'s first token leaves now; it decodes in ``replica``'s next steps."""
        self.first_token(req, now)
        if req.output <= 1:
            return
        replica.num_running += 1
        replica.ctx += req.prompt + 1
        heapq.heappush(replica.finishes, (replica.steps + req.output - 1, req.index, req))
