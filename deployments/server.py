"""EngineServer: one engine replica. The same class is deployed as ``PrefillServer``,
``DecodeServer`` and ``ColocatedServer``; only the initial role differs.

Thin: it builds the engine and its KV link from the config once, then forwards each call
to ``KVEngineLink`` / ``AsyncEngine``. ``record_routing_stats`` feeds the role-aware
request router (``deployments.router``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from app.config import AppConfig
from engine.params import EngineStats, GenerationRequest, PrefillResult, RequestOutput, Role, TokenLogprobs
from kv_transport.base import TransferStats
from kv_transport.handle import KVDestination, KVHandle


class EngineServer:
    def __init__(self, config: dict[str, Any], role: str, pool: str) -> None:
        import torch

        self.config = AppConfig.model_validate(config)
        self.pool_config = getattr(self.config, pool)
        torch.set_num_threads(self.pool_config.torch_threads)
        from engine.config import EngineConfig
        from engine.core import EngineCore
        from engine.loader import ModelSpec, load_model

        spec = self.config.model
        loaded = load_model(ModelSpec(source=spec.source, dtype=spec.dtype, device=spec.device))
        settings = self.config.engine.model_dump()
        self.core = EngineCore(loaded, EngineConfig(role=Role(role), max_model_len=spec.max_model_len, **settings))
        self.engine_id = f"{pool}-{os.getpid()}-{id(self):x}"
        from deployments.metrics import EngineMetrics

        self.metrics = EngineMetrics(pool)
        self._link = None
        self._start_lock = asyncio.Lock()

    async def _started(self):
        """The engine loop and the transport need the replica's event loop: start on first use."""
        if self._link is None:
            async with self._start_lock:
                if self._link is None:
                    self._link = self._make_link()
        return self._link

    def _make_link(self):
        from engine.async_engine import AsyncEngine
        from kv_transport.engine_link import KVEngineLink
        from kv_transport.handle import KVLayoutSignature

        layout = KVLayoutSignature.of(self.core.layout)
        timeout_s = self.config.transport.kv_transfer_timeout_s
        if self.config.transport.kind == "nixl":
            from kv_transport.nixl_transport import NixlTransport
            from kv_transport.registry import RayPeerRegistry

            transport = NixlTransport(self.engine_id, layout, RayPeerRegistry(), timeout_s)
        else:
            from kv_transport.object_store import ObjectStoreTransport

            transport = ObjectStoreTransport(self.engine_id, layout, timeout_s)
        return KVEngineLink(AsyncEngine(self.core, self.pool_config.torch_threads), transport)

    # ---- the calls the ingress makes ----------------------------------------------------

    async def prefill(self, request: GenerationRequest) -> tuple[PrefillResult, KVHandle | None]:
        link = await self._started()
        start = time.perf_counter()
        result = await link.prefill_pull(request)
        self.metrics.prefill.observe(time.perf_counter() - start, self.metrics.pool)
        self.metrics.prefill_parts(result[0].queue_s, result[0].compute_s)
        return result

    async def decode_pull(
        self, request: GenerationRequest, handle: KVHandle, first_logprobs: TokenLogprobs | None = None
    ) -> AsyncIterator[RequestOutput]:
        link = await self._started()
        try:
            async for output in link.decode_pull(request, handle, first_logprobs):
                parts = link.ttft_parts.pop(request.request_id, None)
                if parts is not None:
                    self.metrics.decode_queue.observe(parts["decode_queue_s"], self.metrics.pool)
                    self.metrics.transfer(parts["kv_transfer_s"], int(parts["kv_bytes"]))
                yield output
        finally:
            link.ttft_parts.pop(request.request_id, None)

    async def decode_push(self, request: GenerationRequest) -> AsyncIterator[KVDestination | RequestOutput]:
        """One stream: first the destination (blocks reserved here), then the tokens."""
        link = await self._started()
        try:
            destination = await link.reserve_push(request)
            parts = link.ttft_parts.pop(request.request_id)
            self.metrics.decode_queue.observe(parts["decode_queue_s"], self.metrics.pool)
            yield destination
            async for output in link.decode_push(request, destination):
                yield output
        finally:
            link.ttft_parts.pop(request.request_id, None)

    async def prefill_push(
        self, request: GenerationRequest, destination: KVDestination
    ) -> tuple[PrefillResult, TransferStats]:
        link = await self._started()
        start = time.perf_counter()
        result, stats = await link.prefill_push(request, destination)
        self.metrics.prefill.observe(time.perf_counter() - start, self.metrics.pool)
        self.metrics.prefill_parts(result.queue_s, result.compute_s)
        self.metrics.transfer(stats.seconds, stats.num_bytes)
        return result, stats

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        link = await self._started()
        async for output in link.engine.generate(request):
            if output.prefill_timing is not None:
                self.metrics.prefill_parts(*output.prefill_timing)
            yield output

    async def abort(self, request_id: str) -> None:
        link = await self._started()
        await link.abort(request_id)

    async def stats(self) -> EngineStats:
        link = await self._started()
        return await link.engine.stats()

    async def set_role(self, role: str) -> None:
        link = await self._started()
        await link.engine.set_role(role)

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
        """Read by Serve every ``request_routing_stats_period_s`` for the request router."""
        stats = self.core.stats()
        routing = {
            "role": stats.role.value,
            "free_blocks": stats.num_free_blocks,
            "total_blocks": stats.num_total_blocks,
            "running": stats.num_running,
            "waiting": stats.num_waiting,
        }
        self.metrics.replica(routing)
        return routing
