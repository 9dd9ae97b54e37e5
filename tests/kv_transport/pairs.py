"""Two NixlTransports in one process sharing a registry: producer and consumer of one test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from engine.kv_pool import KVLayout
from kv_transport.nixl_transport import NixlTransport
from kv_transport.registry import LocalPeerRegistry
from tests.waiting import CallRecorder


@contextmanager
def transport_pair(
    layout: KVLayout,
    src: torch.Tensor,
    dst: torch.Tensor,
    timeout_s: float,
    producer_options: dict | None = None,
    consumer_released: Callable[[str], None] = lambda rid: None,
    **consumer_options,
) -> Iterator[tuple[NixlTransport, NixlTransport, torch.Tensor, torch.Tensor, CallRecorder, LocalPeerRegistry]]:
    """``(producer, consumer, src, dst, released, registry)``: ``src`` is the producer's pool,
    ``dst`` the consumer's; ``released`` records the producer's released request ids
    (``consumer_released`` is the consumer's callback). Options (``staging``, ...) go to each
    side's ``NixlTransport``."""
    registry = LocalPeerRegistry()
    producer = NixlTransport("prod", layout, registry, kv_transfer_timeout_s=timeout_s, **(producer_options or {}))
    consumer = NixlTransport("cons", layout, registry, kv_transfer_timeout_s=timeout_s, **consumer_options)
    released = CallRecorder()
    try:
        producer.register_pool(src, released)
        consumer.register_pool(dst, consumer_released)
        yield producer, consumer, src, dst, released, registry
    finally:
        producer.close()
        consumer.close()
