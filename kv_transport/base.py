"""The KV transport contract and its typed errors.

A transport moves the KV of one request from a producer engine's pool (prefill) into a
consumer engine's pool (decode). Ray carries only ``KVHandle`` / ``KVDestination``; the
bytes go over the transport. Two modes:

* **pull**: the producer ``export``s pinned blocks as a handle; the consumer ``fetch``es
  them into blocks it allocated, then the producer is told to ``release`` them.
* **push**: the consumer reserves blocks and publishes a ``destination``; the producer
  calls ``push_layer`` after each layer's forward (writes overlap the next layer's
  compute), then ``finish_push``; the consumer ``wait_push``es for completion.

Who frees what: the producer's blocks are the producer engine's; the transport calls the
``release_blocks`` callback given to ``register_pool`` exactly once per exported request
(on the consumer's release notice, on abort, or when ``kv_transfer_timeout_s`` passes
unclaimed). The consumer's blocks are the consumer's: on any error raised here the caller
still owns them and must free them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.params import TokenLogprobs
from kv_transport.handle import KVDestination, KVHandle

if TYPE_CHECKING:
    import torch

ReleaseBlocks = Callable[[str], None]


class KVCapacityError(RuntimeError):
    """This engine has no free blocks for the request's KV right now (retry elsewhere or later).

    Built from its message alone, so it pickles as itself: through Ray the caller gets this
    type (as the ``cause`` of Ray's task error) and can catch it by type.
    """


class KVTransferError(RuntimeError):
    """A transfer failed; names the request and the peer engine."""

    def __init__(self, message: str, request_id: str, peer: str) -> None:
        super().__init__(f"{message} (request {request_id}, peer {peer})")
        self.message = message
        self.request_id = request_id
        self.peer = peer

    def __reduce__(self) -> tuple:
        # keeps the type and fields across Ray (pickle would call cls(formatted message))
        return (self.__class__, (self.message, self.request_id, self.peer))


class KVTransferTimeout(KVTransferError):
    """No completion within ``kv_transfer_timeout_s`` (peer dead, slow, or gone)."""


class ReadStillPosted(KVTransferTimeout):
    """A READ's wait timed out with the READ still posted: it may land yet, so the blocks it
    reads into stay held (``NixlTransport.reading``)."""


class StalePeerError(KVTransferError):
    """The handle names an engine incarnation the registry does not hold (restarted or stopped)."""


class LayoutMismatchError(KVTransferError):
    """The two pools differ in dtype, layers, block size, heads or head dim."""


@dataclass(frozen=True)
class LayerTiming:
    """One pushed layer's write, in unix seconds: its forward ended, the write was posted, done."""

    layer: int
    compute_end: float
    posted: float
    done: float


@dataclass(frozen=True)
class TransferStats:
    """What one request's transfer cost; ``layer_times`` only for push (in push order)."""

    num_bytes: int
    seconds: float
    num_descriptors: int
    layer_times: tuple[LayerTiming, ...] = ()
    rank_bytes: tuple[int, ...] = ()  # a tensor-parallel consumer: what each rank read, by rank
    notice_sent: float | None = None  # a push: when its completion notice was handed to NIXL (unix s)


@dataclass(frozen=True)
class PushCompletion:
    """What the consumer learns when a push completes: the first token prefill sampled (and its
    log-probabilities, when the request asked for them), and when the done notice was read
    (unix s; None where the transport has no notice)."""

    first_token: int
    first_logprobs: TokenLogprobs | None = None
    received_at: float | None = None


class BaseKVTransport(ABC):
    """One per engine process. Methods are safe to call from the event loop; ``push_layer``
    is called from the engine thread inside the forward pass and never blocks on I/O."""

    supports_push: bool = True
    num_expired_exports: int = 0  # producer: exports never claimed, freed at their lease's end (since start)

    @abstractmethod
    def register_pool(self, pool: torch.Tensor, release_blocks: ReleaseBlocks) -> None:
        """Register the engine's whole KV pool once and publish this engine to the peer registry."""

    @abstractmethod
    def export(self, request_id: str, block_ids: list[int], num_tokens: int, first_token: int) -> KVHandle:
        """Producer, pull: hand out pinned blocks; they are released via the callback later."""

    @abstractmethod
    async def fetch(self, handle: KVHandle, local_block_ids: list[int], skip_blocks: int = 0) -> TransferStats:
        """Consumer, pull: copy the handle's blocks into ``local_block_ids``, then notify the producer.
        The first ``skip_blocks`` local blocks hold that KV already (the consumer's prefix
        cache): only the rest is copied (and counted).

        Raises ``StalePeerError``, ``LayoutMismatchError``, ``KVTransferTimeout`` or
        ``KVTransferError``; on error the local blocks hold no valid KV.
        """

    @abstractmethod
    def destination(
        self, request_id: str, block_ids: list[int], num_tokens: int, skip_blocks: int = 0
    ) -> KVDestination:
        """Consumer, push: describe reserved blocks for a producer to write into (the first
        ``skip_blocks`` hold their KV already: the producer writes none of them)."""

    @abstractmethod
    def begin_push(self, destination: KVDestination) -> None:
        """Producer, push: resolve the peer and check the layout before the forward pass."""

    @abstractmethod
    def push_layer(self, request_id: str, layer: int, local_block_ids: Sequence[int], start_index: int) -> None:
        """Producer, push: post the write of one layer's K and V, non-blocking.

        ``local_block_ids[k]`` goes to the destination's block number ``start_index + k``
        (a prompt chunk writes the blocks it touched).
        """

    @abstractmethod
    async def finish_push(
        self, request_id: str, first_token: int, first_logprobs: TokenLogprobs | None = None
    ) -> TransferStats:
        """Producer, push: wait for every posted write, then send the consumer its completion
        notice (``PushCompletion``: the first token and its log-probabilities)."""

    @abstractmethod
    async def wait_push(self, destination: KVDestination) -> PushCompletion:
        """Consumer, push: wait for the producer's completion notice (or ``KVTransferTimeout``)."""

    @abstractmethod
    def abort_push(self, request_id: str) -> None:
        """Either side: forget a push (producer: tell the consumer it failed)."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Producer: the exported blocks are no longer needed (idempotent)."""

    def frees_later(self, request_id: str) -> bool:
        """Consumer: a transfer into the request's blocks here ended unfinished (a pull's READ
        still posted, a push whose producer may still write). True: the transport frees them
        (``release_blocks``) once nothing can land in them any more; False: free them now.
        The default: nothing lands after a transfer ends."""
        return False

    def give_back(self, handle: KVHandle) -> None:
        """Consumer, pull: the handle will not be fetched (the request failed or went away
        first): tell its producer to free the blocks now rather than at the lease's end.
        Best effort; the default does nothing (the lease bounds the wait)."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Leave the registry and free transport resources."""
