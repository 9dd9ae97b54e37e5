"""Peer registry: where engines publish their NIXL agent metadata and pool layout.

Agent metadata is several KB, so it never travels in handles. Each engine publishes one
entry at start under its engine id, holding its current incarnation, and removes it at
stop. A consumer looks a producer up once per (engine id, incarnation) and caches it; a
handle naming any other incarnation is refused with ``StalePeerError`` (the engine
restarted or stopped, so its old metadata and addresses are meaningless).

``RayPeerRegistry`` stores entries in Ray's internal key-value store (GCS), readable
from every process of the cluster without addressing any Serve replica.
"""

from __future__ import annotations

import pickle
from abc import ABC, abstractmethod
from dataclasses import dataclass

from engine.kv_pool import KVLayout
from kv_transport.base import StalePeerError

_NAMESPACE = "tandem_kv_peers"


@dataclass(frozen=True)
class PeerInfo:
    engine_id: str
    incarnation: str
    agent_name: str
    agent_metadata: bytes  # the agent that moves the data
    notice_agent_metadata: bytes  # the agent that sends and receives notices
    layout: KVLayout
    pool_address: int  # base address of the pool tensor in the owner's process
    num_blocks: int
    device_id: int
    mem_type: str  # "DRAM" or "VRAM"


class BasePeerRegistry(ABC):
    @abstractmethod
    def publish(self, info: PeerInfo) -> None:
        """Make ``info`` the current entry for its engine id (replacing an older incarnation)."""

    @abstractmethod
    def remove(self, engine_id: str, incarnation: str) -> None:
        """Drop the entry if it is still this incarnation's."""

    @abstractmethod
    def current(self, engine_id: str) -> PeerInfo | None:
        """The engine's current entry, if any."""

    def lookup(self, engine_id: str, incarnation: str, request_id: str = "?") -> PeerInfo:
        info = self.current(engine_id)
        if info is None:
            raise StalePeerError(f"engine {engine_id} is not in the peer registry", request_id, engine_id)
        if info.incarnation != incarnation:
            raise StalePeerError(
                f"engine {engine_id} incarnation {incarnation} is stale (current: {info.incarnation})",
                request_id,
                engine_id,
            )
        return info


class RayPeerRegistry(BasePeerRegistry):
    """Entries in Ray's internal KV store; needs ``ray.init`` (or a Ray worker) in this process."""

    def publish(self, info: PeerInfo) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(info.engine_id, pickle.dumps(info), overwrite=True, namespace=_NAMESPACE)

    def remove(self, engine_id: str, incarnation: str) -> None:
        from ray.experimental.internal_kv import _internal_kv_del

        current = self.current(engine_id)
        if current is not None and current.incarnation == incarnation:
            _internal_kv_del(engine_id, namespace=_NAMESPACE)

    def current(self, engine_id: str) -> PeerInfo | None:
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(engine_id, namespace=_NAMESPACE)
        return pickle.loads(raw) if raw else None


class LocalPeerRegistry(BasePeerRegistry):
    """Entries in a dict, for engines that share one process (benchmarks, single-process runs)."""

    def __init__(self) -> None:
        self._entries: dict[str, PeerInfo] = {}

    def publish(self, info: PeerInfo) -> None:
        self._entries[info.engine_id] = info

    def remove(self, engine_id: str, incarnation: str) -> None:
        current = self._entries.get(engine_id)
        if current is not None and current.incarnation == incarnation:
            del self._entries[engine_id]

    def current(self, engine_id: str) -> PeerInfo | None:
        return self._entries.get(engine_id)
