"""Build the configured KV transport of one engine (the Serve deployments and the benchmarks' actors)."""

from __future__ import annotations

from engine.kv_pool import KVLayout
from kv_transport.base import BaseKVTransport
from kv_transport.config import TransportConfig
from kv_transport.faults import NO_FAULTS, TRANSPORT_POINTS, FaultPoints
from kv_transport.nixl_transport import NixlTransport
from kv_transport.object_store import ObjectStoreTransport
from kv_transport.registry import BasePeerRegistry, RayPeerRegistry


def make_transport(
    config: TransportConfig,
    engine_id: str,
    layout: KVLayout,
    *,
    registry: BasePeerRegistry | None = None,
    faults: FaultPoints = NO_FAULTS,
    peer_check_interval_s: float | None = None,
) -> BaseKVTransport:
    """The transport of ``config.kind`` for the engine ``engine_id`` whose pool has ``layout``.

    NIXL only: ``registry`` (default: Ray's, which needs Ray in this process), ``faults`` and
    ``peer_check_interval_s`` (default: the config's). The object store has neither peers nor fault points: a fault
    at a transport point given for it is refused (``ValueError``).
    """
    timeout_s = config.kv_transfer_timeout_s
    if config.kind == "nixl":
        interval = config.peer_check_interval_s if peer_check_interval_s is None else peer_check_interval_s
        return NixlTransport(
            engine_id,
            layout,
            registry or RayPeerRegistry(),
            timeout_s,
            faults,
            interval,
            staging=config.staging,
            staging_bytes=config.staging_bytes,
        )
    if any(rule.point in TRANSPORT_POINTS or rule.point == "release" for rule in faults.rules):
        raise ValueError("the object-store transport has no fault points")
    return ObjectStoreTransport(engine_id, layout, timeout_s)
