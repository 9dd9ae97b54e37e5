"""EngineServer: one engine replica. The same class is deployed as ``PrefillServer``,
``DecodeServer`` and ``ColocatedServer``; only the initial role differs.

Thin: it builds the engine and its KV link from the config once, then forwards each call
to ``KVEngineLink`` / ``AsyncEngine``. ``record_routing_stats`` feeds the role-aware
request router (``deployments.router``) from the engine thread's stats snapshot (every
``EngineCore`` call stays on the engine thread).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from app.settings import POOL_SECTIONS, AppConfig
from autoscaling.messages import PoolTarget, ReplicaReport
from autoscaling.serve_policy import SEQ_METRIC, TARGET_METRIC
from deployments import logs
from deployments.background import keep_running
from engine.params import EngineStats, GenerationRequest, PrefillResult, RequestOutput, Role, TokenLogprobs
from kv_transport.base import TransferStats
from kv_transport.handle import KVDestination, KVHandle

logger = logs.install()  # Serve's logger: the replica's log file, INFO included; expected errors in one line

if TYPE_CHECKING:
    from engine.core import EngineCore
    from kv_transport.engine_link import KVEngineLink


def _load_core(config: AppConfig, role: Role, engine_id: str) -> EngineCore:
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.loader import ModelSpec, load_model
    from engine.tensor_parallel import check_degree

    model = config.model
    spec = ModelSpec(source=model.source, dtype=model.dtype, device=model.device)
    loaded = load_model(spec)
    pool = config.pool(role)
    degree, launch = pool.tensor_parallel_size, None
    if degree > 1:
        from deployments.tp_workers import ray_launcher
        from kv_transport.sharded import RankKV

        check_degree(loaded.model.config, degree, f"{POOL_SECTIONS[role]}.tensor_parallel_size")
        launch = ray_launcher(spec, pool.bundle(), pool.torch_threads, RankKV(config.transport, engine_id))
    settings = config.engine.model_dump()
    limits = {"role": role, "max_model_len": model.max_model_len, "speculative": config.speculative}
    return EngineCore(loaded, EngineConfig(**limits, **settings, tensor_parallel_size=degree), launch)


REPORT_PERIOD_S = 0.25  # how often a replica looks for a change of load to report to the autoscaler
DRAIN_POLL_S = 0.1
STALL_S = 60.0  # check_health fails when one engine round has run this long (a wedged step)
AFTER_EXPORT_CRASH_S = 0.05  # an ``after_export`` crash comes this long after the handle went back
AFTER_PUSH_CRASH_S = 2.0  # an ``after_push`` crash: time for the decode replica to start streaming


def _crash_gate(faults_key: str):
    """Count crashes in Ray's key-value store, so ``max_times`` holds across restarts: crash
    number n claims the key ``<faults_key>/<rule>/<n>``; no free slot left, no crash."""

    def gate(index: int, rule: Any) -> bool:
        from ray.experimental.internal_kv import _internal_kv_put

        if rule.max_times is None:
            return True
        for n in range(rule.max_times):
            key = f"{faults_key}/{index}/{n}"
            if not _internal_kv_put(key, b"1", overwrite=False, namespace="tandem_faults"):
                return True  # the slot was free: this crash is number n
        return False

    return gate


def _fault_points(config: AppConfig) -> Any:
    import hashlib

    from kv_transport.faults import NO_FAULTS, FaultPoints

    if not config.faults:
        return NO_FAULTS
    rules = json.dumps([rule.model_dump() for rule in config.faults], sort_keys=True)
    key = hashlib.blake2b(rules.encode(), digest_size=8).hexdigest()  # one count per set of rules
    return FaultPoints(config.faults, crash_gate=_crash_gate(key))


class EngineServer:
    def __init__(self, config: AppConfig, home: Role, controller: Any = None) -> None:
        """``config``: the application's settings, validated once by the builder; ``home``: the
        pool's role and the replica's initial one (``both``: colocated); the pool's section of
        the config is ``config.pool(home)``, its name the metrics' ``pool`` label;
        ``controller``: the autoscaler's controller handle (disagg_app with autoscaling on),
        which the replica reports its load to and takes its assigned role from."""
        import torch

        from deployments.metrics import EngineMetrics
        from engine.async_engine import AsyncEngine

        self.config = config
        self.home = Role(home)
        section = POOL_SECTIONS[self.home]
        torch_threads = config.pool(self.home).torch_threads
        torch.set_num_threads(torch_threads)
        self.engine_id = f"{section}-{os.getpid()}-{id(self):x}"
        self.core = _load_core(config, self.home, self.engine_id)
        self.engine = AsyncEngine(self.core, torch_threads)
        self.metrics = EngineMetrics(section)
        self._link: KVEngineLink | None = None
        self._start_lock = asyncio.Lock()
        self._controller = controller
        self._reporter: asyncio.Task | None = None
        self._target: PoolTarget | None = None  # the replica-count decision for Serve (record_autoscaling_stats)
        self._stopping = False
        self.faults = _fault_points(self.config)
        self._kv_publisher: asyncio.Task | None = None
        self._start_reporting()

    async def _started(self) -> KVEngineLink:
        """The engine loop and the transport need the replica's event loop: start on first use."""
        self._start_reporting()
        if self._link is None:
            async with self._start_lock:
                if self._link is None:
                    self._link = self._make_link()
        return self._link

    def _start_reporting(self) -> None:
        """Report to the controller, and publish the KV accounting, from the replica's event
        loop (from the constructor when Serve runs it on that loop, else from the first call
        or health check). Each loop runs in a context of its own: the call that happened to
        start it would otherwise lend it its request id (its log lines, its calls)."""
        if self._stopping:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._kv_publisher = keep_running(self._kv_publisher, self._publish_kv_loop)
        if self._controller is not None:
            self._reporter = keep_running(self._reporter, self._report_loop)

    async def _publish_kv_loop(self) -> None:
        """``GET /admin/kv``'s data (``deployments.kv_state``), about once a second."""
        import psutil
        import ray
        from ray import serve

        from deployments import kv_state

        process = psutil.Process()
        context = serve.get_replica_context()
        replica = {
            "engine_id": self.engine_id,
            "app": context.app_name,
            "deployment": context.deployment,
            "replica_id": context.replica_id.unique_id,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
        }
        link = await self._started()
        ranks = await asyncio.to_thread(self.core.ranks)  # fixed for the replica's life
        swept = time.monotonic()
        while True:
            try:
                report = await self.engine.kv_report()
                spec = kv_state.speculative(self.engine.latest_stats())
                expired = link.transport.num_expired_exports  # read after the report: it counts what the report freed
                extra = {"rss_bytes": process.memory_info().rss, "speculative": spec, "ranks": ranks,
                         "expired_exports": expired}  # fmt: skip
                data = kv_state.entry(report, {**replica, **extra})
                await asyncio.to_thread(kv_state.publish, self.engine_id, data)
                if time.monotonic() - swept > kv_state.SWEEP_PERIOD_S:
                    swept = time.monotonic()
                    await asyncio.to_thread(kv_state.read_all)  # forgets the replicas silent too long
            except Exception as exc:  # the GCS briefly away: the entry ages meanwhile
                logger.warning("KV state not published: %s", exc)
            await asyncio.sleep(kv_state.PUBLISH_PERIOD_S)

    async def _report_loop(self) -> None:
        from ray import serve

        context = serve.get_replica_context()
        replica, deployment = context.replica_id.unique_id, context.deployment
        # an unchanged load is sent once per decision interval (never stale: stale_after_s is
        # at least that), a changed one at once: an idle app's calls cost CPU others could use
        quiet_s = self.config.autoscaling.load(self.config.slo.ttft_ms, self.config.slo.tpot_ms).interval_s
        changing: asyncio.Task | None = None
        sent, sent_at = None, -math.inf
        while True:
            stats = self.engine.latest_stats()
            if stats != sent or time.monotonic() - sent_at >= quiet_s:
                try:
                    answer = await self._controller.report.remote(ReplicaReport(replica, deployment, self.home, stats))
                    sent, sent_at = stats, time.monotonic()
                    role = answer.role
                    if answer.target is not None:
                        self._target = answer.target
                    if role is not stats.role and (changing is None or changing.done()):
                        # applied between engine steps (a step may take seconds): keep reporting meanwhile
                        changing = asyncio.get_running_loop().create_task(self._apply_role(stats.role, role))
                except Exception as exc:  # the controller restarting, say: keep the role, retry
                    logger.warning("autoscaler report failed: %s", exc)
            await asyncio.sleep(REPORT_PERIOD_S)

    async def _apply_role(self, old: Role, role: Role) -> None:
        await self._started()
        await self.engine.set_role(role)
        logger.info("role %s -> %s (assigned by the autoscaler)", old.value, role.value)

    async def check_health(self) -> None:
        """Serve calls this periodically; raising makes Serve replace the replica. Unhealthy:
        the engine thread ended, or one engine round has run over ``STALL_S`` (wedged)."""
        self._start_reporting()
        problem = self.engine.health_problem(STALL_S)
        if problem is not None:
            logger.error("unhealthy: %s", problem)
            raise RuntimeError(problem)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Read by Serve (deployments with replica scaling): the controller's decision for
        this replica's deployment, relayed to Serve's policy (``autoscaling/serve_policy.py``)."""
        target = self._target
        return {} if target is None else {TARGET_METRIC: target.num_replicas, SEQ_METRIC: target.seq}

    async def __del__(self) -> None:
        """Serve's graceful stop (scale-down, redeploy, shutdown) calls this once the replica's
        ongoing calls have ended (their decodes finished): return a lent replica home, then
        keep the KV this replica exported until its decode replica fetched it (or its lease
        ran out), so a scale-down loses nothing; bounded by the transfer timeout. Then the
        transport closes: its peer-registry entry goes, so a handle naming this engine is
        refused as stale (``StalePeerError``) instead of failing its READ."""
        self._stopping = True
        for task in (self._reporter, self._kv_publisher):
            if task is not None:
                task.cancel()
        try:
            if self._link is not None:
                await self._drain()
        finally:
            await self.engine.stop()
            await self._close_link()
            await asyncio.to_thread(self.core.close)  # a tensor-parallel replica's other ranks

    async def _drain(self) -> None:
        await self._report_stopping()
        if self.engine.latest_stats().role is not self.home:
            await self.engine.set_role(self.home)
        deadline = time.monotonic() + self.config.transport.kv_transfer_timeout_s + 1
        stats = await self.engine.stats()
        while (stats.num_pinned_blocks or stats.num_running or stats.num_waiting) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
            stats = await self.engine.stats()
        logger.info(
            "stopped: %d exported block(s) left unfetched, %d request(s) left",
            stats.num_pinned_blocks,
            stats.num_running + stats.num_waiting,
        )
        await self._forget_kv_state()

    async def _forget_kv_state(self) -> None:
        from deployments import kv_state

        try:
            await asyncio.to_thread(kv_state.remove, self.engine_id)
        except Exception as exc:  # the cluster going down
            logger.info("stopping: KV state entry not removed (%s)", type(exc).__name__)

    async def _close_link(self) -> None:
        if self._link is None:
            return
        try:
            await asyncio.to_thread(self._link.close)
        except Exception as exc:  # the cluster going down: the peer registry out of reach
            logger.info("stopping: KV transport not closed cleanly (%s)", type(exc).__name__)

    async def _report_stopping(self) -> None:
        """Tell the controller at once, so its counts leave this replica out."""
        if self._controller is None:
            return
        from ray import serve

        context = serve.get_replica_context()
        stats = self.engine.latest_stats()
        report = self._controller.report.remote(
            ReplicaReport(context.replica_id.unique_id, context.deployment, self.home, stats, stopping=True)
        )
        try:
            await asyncio.wait_for(report, timeout=2.0)
        except Exception as exc:  # the controller already stopped (the whole app going down)
            logger.info("stopping: the autoscaler's controller did not answer (%s)", type(exc).__name__)

    def _make_link(self) -> KVEngineLink:
        from kv_transport.engine_link import KVEngineLink
        from kv_transport.factory import make_transport

        layout = self.engine.pool_view().layout
        transport = make_transport(self.config.transport, self.engine_id, layout, faults=self.faults)
        if self.core.tp is not None:  # the other ranks read their own heads (kv_transport.sharded)
            from kv_transport.sharded import ShardedTransport

            transport = ShardedTransport(transport, self.engine, self.core.tp, self.core.model_config)
        return KVEngineLink(self.engine, transport)

    # ---- the calls the ingress makes ----------------------------------------------------

    async def prefill(self, request: GenerationRequest) -> tuple[PrefillResult, KVHandle | None]:
        link = await self._started()
        start = time.perf_counter()
        self._fault("prefill", request.request_id)
        result = await link.prefill_pull(request)
        self.metrics.prefill_call(time.perf_counter() - start)
        self.metrics.prefill_parts(result[0].queue_s, result[0].compute_s)
        if self.faults and result[1] is not None:
            asyncio.get_running_loop().call_later(AFTER_EXPORT_CRASH_S, self._fault, "after_export", request.request_id)
        return result

    def _fault(self, point: str, request_id: str) -> None:
        """A replica fault point (``kv_transport.faults``): only crashes are configured here."""
        if self.faults:
            self.faults.hit(point, request_id, self.engine_id)

    async def _crash_mid_decode(
        self, request_id: str, outputs: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[RequestOutput]:
        """``outputs``, with the ``mid_decode`` fault point once a rule's ``after_tokens`` went out."""
        selected = self.faults.selected("mid_decode", request_id) if self.faults else []
        sent = 0
        async for output in outputs:
            yield output
            sent += len(output.token_ids)
            for _, rule in selected:
                if sent >= rule.after_tokens:
                    self._fault("mid_decode", request_id)

    async def decode_pull(
        self, request: GenerationRequest, handle: KVHandle, first_logprobs: TokenLogprobs | None = None
    ) -> AsyncIterator[RequestOutput]:
        link = await self._started()
        try:
            async for output in self._crash_mid_decode(
                request.request_id, link.decode_pull(request, handle, first_logprobs)
            ):
                timings = link.pop_decode_timings(request.request_id)
                if timings is not None:
                    self.metrics.decode_parts(timings)
                yield output
        finally:
            link.pop_decode_timings(request.request_id)

    async def decode_push(self, request: GenerationRequest) -> AsyncIterator[KVDestination | RequestOutput]:
        """One stream: first the destination (blocks reserved here), then the tokens."""
        link = await self._started()
        try:
            destination = await link.reserve_push(request)
            timings = link.pop_decode_timings(request.request_id)
            if timings is not None:
                self.metrics.decode_parts(timings)
            try:
                yield destination
            except BaseException:  # the stream ended here (the request gone): nothing waits for the push
                await link.drop_push(request.request_id)
                raise
            async for output in self._crash_mid_decode(request.request_id, link.decode_push(request, destination)):
                yield output
        finally:
            link.pop_decode_timings(request.request_id)

    async def prefill_push(
        self, request: GenerationRequest, destination: KVDestination
    ) -> tuple[PrefillResult, TransferStats]:
        link = await self._started()
        start = time.perf_counter()
        self._fault("prefill", request.request_id)
        result, stats = await link.prefill_push(request, destination)
        if self.faults and self.faults.crash_due("after_push", request.request_id):
            from kv_transport.faults import crash_now

            await asyncio.sleep(AFTER_PUSH_CRASH_S)  # the completion notice went; this call's reply never does
            crash_now("after_push", request.request_id)
        self.metrics.prefill_call(time.perf_counter() - start)
        self.metrics.prefill_parts(result.queue_s, result.compute_s)
        self.metrics.transfer(stats.seconds, stats.num_bytes)
        return result, stats

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        await self._started()
        async for output in self._crash_mid_decode(request.request_id, self.engine.generate(request)):
            if output.prefill_timing is not None:
                self.metrics.prefill_parts(*output.prefill_timing)
            yield output

    async def abort(self, request_id: str) -> None:
        link = await self._started()
        await link.abort(request_id)

    async def give_back(self, handle: KVHandle) -> None:
        """A pull's KV handle no decode call will read (the ingress's try ended before): its
        producer frees the blocks now, not at the lease's end. Any replica may send it; a
        second notice for one export does nothing."""
        link = await self._started()
        link.transport.give_back(handle)

    async def stats(self) -> EngineStats:
        await self._started()
        return await self.engine.stats()

    async def set_role(self, role: Role) -> None:
        await self._started()
        await self.engine.set_role(Role(role))

    async def model_info(self) -> dict[str, Any]:
        import ray

        return {
            "name": self.core.model_name,
            "max_model_len": self.core.limits.max_model_len,
            "engine_id": self.engine_id,
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    async def last_transfer(self) -> dict[str, float] | None:
        """The most recent pull's transfer figures on this replica (benchmarks, debugging)."""
        link = await self._started()
        stats = link.last_fetch
        return None if stats is None else {"seconds": stats.seconds, "bytes": stats.num_bytes}

    def record_routing_stats(self) -> dict[str, Any]:
        """Read by Serve every ``request_routing_stats_period_s`` for the request router: the
        engine thread's latest snapshot (no call into the core from Serve's thread)."""
        from deployments.router import RoutingStats

        stats = self.engine.latest_stats()
        self.metrics.replica(stats)
        if self._link is not None:
            self.metrics.expired_exports(self._link.transport.num_expired_exports)
        return RoutingStats.of(stats).to_dict()
