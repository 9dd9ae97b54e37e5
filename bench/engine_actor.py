"""A Ray actor holding one engine and its KV link: the process boundary for the KV
transport tests and benchmarks (the Serve deployments wrap the same link)."""

from __future__ import annotations

import os

import ray

from bench.host import engine_core


@ray.remote(num_cpus=0.5)
class EngineActor:
    """One engine in its own process and, after ``start``, its KV link; the methods run the link's steps."""

    def __init__(self, engine_id: str, role: str, transport: str = "nixl", timeout_s: float = 60.0,
                 push_pipelined: bool = True, spec=None, **engine_config) -> None:  # fmt: skip
        """``spec``: the model (default: the default model); ``tensor_parallel_size`` > 1: see ``_tp_core``."""
        from engine.params import Role
        from kv_transport.config import TransportConfig

        engine_config = {"max_model_len": 2048, "kv_cache_bytes": 128 << 20} | engine_config
        self.config = TransportConfig(kind=transport, kv_transfer_timeout_s=timeout_s)
        if spec is None and engine_config.get("tensor_parallel_size", 1) == 1:
            self.core = engine_core(1, role=Role(role), **engine_config)
        else:
            self.core = _tp_core(spec, engine_id, self.config, role=Role(role), **engine_config)
        self.engine_id, self.push_pipelined, self.link = engine_id, push_pipelined, None

    async def start(self) -> str:
        from engine.async_engine import AsyncEngine
        from kv_transport.engine_link import KVEngineLink
        from kv_transport.factory import make_transport
        from kv_transport.sharded import ShardedTransport

        engine = AsyncEngine(self.core)
        transport = make_transport(self.config, self.engine_id, engine.pool_view().layout)
        if self.core.tp is not None:
            transport = ShardedTransport(transport, engine, self.core.tp, self.core.model_config)
        self.link = KVEngineLink(engine, transport, push_pipelined=self.push_pipelined)
        return transport.incarnation

    async def prefill_pull(self, request):
        return await self.link.prefill_pull(request)

    async def decode_pull(self, request, handle, first_logprobs=None):
        return [o async for o in self.link.decode_pull(request, handle, first_logprobs)]

    async def reserve_push(self, request):
        return await self.link.reserve_push(request)

    async def prefill_push(self, request, destination):
        return await self.link.prefill_push(request, destination)

    async def decode_push(self, request, destination):
        return [o async for o in self.link.decode_push(request, destination)]

    async def generate(self, request):
        return [o async for o in self.link.engine.generate(request)]

    async def reserve(self, request_id, num_tokens):
        return await self.link.engine.reserve(request_id, num_tokens)

    async def release(self, request_id):
        await self.link.engine.release(request_id)

    async def stats(self):
        return await self.link.engine.stats()

    async def abort(self, request_id):
        await self.link.abort(request_id)

    def set_faults(self, delay_s=None, fail=(), drop_release=False):
        """New rules; the delays in progress under the old ones end now (``FaultPoints.cut_delays``)."""
        from kv_transport.faults import FaultPoints

        self.link.transport.faults.cut_delays()
        self.link.transport.faults = FaultPoints.of(delay_s, fail, drop_release)

    def set_timeout(self, timeout_s: float) -> None:
        self.link.transport.timeout_s = timeout_s

    def last_fetch_ms(self) -> float:
        return self.link.last_fetch.seconds * 1e3

    def last_fetch_bytes(self) -> int:
        return self.link.last_fetch.num_bytes

    def pid(self) -> int:
        return os.getpid()

    def num_handshakes(self) -> int:
        return self.link.transport.num_handshakes

    def num_expired_exports(self) -> int:
        return self.link.transport.num_expired_exports

    def last_fetch_rank_bytes(self) -> tuple[int, ...]:
        return self.link.last_fetch.rank_bytes

    def ranks(self) -> int:
        """How many ranks a handle or destination of this engine names (0: one rank)."""
        return len(getattr(self.link.transport, "ranks", ()))

    async def close(self) -> None:
        self.link.close()
        await self.link.engine.stop()
        self.core.close()


def _tp_core(spec, engine_id: str, transport, **engine_config):
    """An engine of ``spec`` whose other ranks are actors on this node, with their own agents."""
    import torch

    from deployments.tp_workers import ray_launcher
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.loader import ModelSpec
    from kv_transport.sharded import RankKV

    torch.set_num_threads(1)
    spec = spec or ModelSpec()
    launch = ray_launcher(spec, {"CPU": 0.01}, 1, RankKV(transport, engine_id))
    return EngineCore.from_spec(spec, EngineConfig(**engine_config), launch)
