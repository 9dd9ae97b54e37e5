"""CUDA graphs for decode steps: one kernel launch per step instead of one per op.

An eager decode step on a GPU is bound by the host (every op of every layer launched from
Python: docs/benchmarks/gpu.md). A graph captured once replays the whole step, the model
and the LM head, as one launch. A graph fixes every shape and address it was captured
with, so a step runs from *static* inputs, filled in place before each replay, and is
padded up to fixed sizes:

* the batch to the smallest captured batch size that holds it (1, 2, 4, ..., 64);
* each sequence's block table to a power-of-two number of blocks (at most the pool's),
  padded with block 0 and masked past the sequence's length, as the eager path masks.

One step's static inputs are one flat int64 device tensor (one host-to-device copy)::

    [ token ids (BQ) | positions (BQ) | slots (BQ) | lengths (BQ) | block tables (B x num_blocks) ]

with Q queries per row (BQ = B x Q): 1 in a decode step; in a speculative verify step (a last
token and its proposals per row) the longest row's count rounded up to a power of two, each
shorter row repeating its last query. Padding rows repeat row 0: the same token at the same
position writes the same K/V to the same slot, so the duplicate writes of ``index_copy_``
agree and no other sequence's KV is touched (the pool has no scratch block). Their logits are
computed and dropped.

Only steps of sampled chunks over cached context replay: decode steps, and verify steps where
a verify forward is given (decode rows in them are verify rows without proposals); with
layer hooks, none computing a prompt token (a push's per-layer hook must run in Python, and
``ModelRunner`` checks that). Anything else, or a batch or context beyond the largest size,
runs eagerly. Graphs are captured on first use of each (batch, blocks, queries) size, after
warm-up runs on a side stream, into one memory pool shared by all.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.config import DEFAULT_CUDA_GRAPH_BATCH_SIZES as DEFAULT_BATCH_SIZES
from engine.overlap import FedTokens
from engine.sampling import on_device
from engine.scheduler import ScheduledChunk

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs before a capture (lazy initialisations, allocator state)


def batch_bucket(num_seqs: int, batch_sizes: Sequence[int]) -> int | None:
    """The smallest size in ``batch_sizes`` (sorted) that holds ``num_seqs``; None: none does."""
    i = bisect.bisect_left(batch_sizes, num_seqs)
    return batch_sizes[i] if i < len(batch_sizes) and num_seqs > 0 else None


def blocks_bucket(num_blocks: int, max_blocks: int) -> int | None:
    """Blocks per sequence a graph gathers: the next power of two, at most ``max_blocks`` (the
    pool's); None when ``num_blocks`` itself is more."""
    if num_blocks > max_blocks or num_blocks < 1:
        return None
    return min(1 << (num_blocks - 1).bit_length(), max_blocks)


@dataclass(frozen=True)
class GraphKey:
    batch: int
    num_blocks: int
    num_queries: int = 1  # per row: 1 in a decode step, more in a verify step


def graph_key(
    chunks: Sequence[ScheduledChunk], block_size: int, batch_sizes: Sequence[int], max_blocks: int, max_queries: int = 1
) -> GraphKey | None:
    """The graph a step replays on, or None when it must run eagerly (see the module docstring).
    ``max_queries``: a verify step's most queries per row (``num_speculative_tokens`` + 1; 1: verify
    steps run eagerly); its rows are padded to a power of two, or to ``max_queries`` if less."""
    if not chunks or not all(c.sample and (c.is_decode or _verifies(c)) for c in chunks):
        return None
    longest = max(len(c.token_ids) for c in chunks)
    if longest > max_queries:
        return None
    batch = batch_bucket(len(chunks), batch_sizes)
    num_blocks = blocks_bucket(-(-max(c.start_pos + len(c.token_ids) for c in chunks) // block_size), max_blocks)
    if batch is None or num_blocks is None:
        return None
    return GraphKey(batch, num_blocks, min(1 << (longest - 1).bit_length(), max_queries))


def _verifies(chunk: ScheduledChunk) -> bool:
    """A decoding sequence's last token and its proposals."""
    return chunk.num_draft > 0 and len(chunk.token_ids) == chunk.num_draft + 1 and not chunk.in_prompt


def decode_inputs(
    chunks: Sequence[ScheduledChunk], key: GraphKey, block_size: int, fed: FedTokens | None = None
) -> list[int]:
    """The step's flat static inputs (layout in the module docstring), padded to ``key``:
    rows past ``len(chunks)`` repeat row 0, tables past a sequence's blocks hold block 0. With
    ``fed``, the token ids' place holds each row's index into ``fed.tokens`` instead."""
    padding = key.batch - len(chunks)
    rows = list(chunks) + [chunks[0]] * padding
    ids, positions, slots, lengths, tables = [], [], [], [], []
    for c in rows:
        for q in range(key.num_queries):  # a row shorter than num_queries repeats its last query
            i = min(q, len(c.token_ids) - 1)
            pos = c.start_pos + i
            ids.append(c.token_ids[i])
            positions.append(pos)
            slots.append(c.block_ids[pos // block_size] * block_size + pos % block_size)
            lengths.append(pos + 1)
        table = list(c.block_ids[: key.num_blocks])
        tables.extend(table + [0] * (key.num_blocks - len(table)))
    if fed is not None:
        if key.num_queries != 1:
            raise ValueError("tokens are fed from the device to decode steps only")
        ids = [*fed.rows, *[fed.rows[0]] * padding]
    return ids + positions + slots + lengths + tables


class StaticDecode:
    """One graph's static inputs on the device, as views of one flat buffer."""

    def __init__(self, key: GraphKey, block_size: int, device: torch.device) -> None:
        b, n, bq = key.batch, key.num_blocks, key.batch * key.num_queries
        self.key = key
        self.inputs = torch.zeros(4 * bq + b * n, dtype=torch.int64, device=device)
        per_query = (self.inputs[i * bq : (i + 1) * bq] for i in range(4))
        self.token_ids, self.positions, self.slots, self.lengths = per_query
        self.block_tables = self.inputs[4 * bq :].view(b, n)
        self.queries = torch.arange(bq, device=device)  # a verify step's queries, in order
        self.context = torch.arange(n * block_size, device=device)
        # a 4-D mask makes transformers' mask builder return at once: it would otherwise look
        # for packed sequences in the positions, a host sync (paged attention masks by itself)
        self.model_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)

    def decode_mask(self) -> torch.Tensor:
        """``[batch, 1, 1, num_blocks * block_size]``: True at each sequence's own positions."""
        b = self.key.batch
        return (self.context[None, :] < self.lengths[:, None]).view(b, 1, 1, -1)

    def verify_mask(self, group: int) -> torch.Tensor:
        """``[batch, 1, group * num_queries, num_blocks * block_size]``: each query of a verify row
        (``engine.attention.VerifyBatch``'s order, ``group`` query heads per KV head) sees its
        row's context up to its own position."""
        b, nq = self.key.batch, self.key.num_queries
        seen = (self.context[None, :] < self.lengths[:, None]).view(b, 1, 1, nq, -1)
        return seen.expand(-1, -1, group, -1, -1).reshape(b, 1, group * nq, -1)


class BaseGraph(Protocol):
    """A captured step: ``capture(fn)`` returns ``fn``'s output tensor, which each ``replay()``
    refills from the static inputs' current values."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class TorchCudaGraph:
    """``torch.cuda.CUDAGraph``, warmed up on a side stream, captured into a shared memory pool."""

    def __init__(self, pool: object) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        # thread_local: other threads (the KV transport's copies and event queries) go on
        # during a capture; only this thread's unsafe calls would break it
        with torch.cuda.graph(self._graph, pool=self._pool, capture_error_mode="thread_local"):
            out = fn()
        return out

    def replay(self) -> None:
        self._graph.replay()


@dataclass
class _Captured:
    static: StaticDecode
    graph: BaseGraph
    logits: torch.Tensor  # [batch * num_queries, vocab] float32, refilled by each replay


class DecodeGraphs:
    """Decode steps replayed from graphs, one per ``GraphKey``, captured on first use.

    ``forward(static)`` runs the model and LM head on a ``StaticDecode`` (the runner gives
    it); ``verify_forward`` the same for verify steps of at most ``max_queries`` queries per row
    (None: they run eagerly, as after a verify graph failed to capture);
    ``graph_type(pool)`` makes a graph (default ``TorchCudaGraph``; CPU tests give a fake, as
    there is no GPU there).
    """

    def __init__(
        self,
        forward: Callable[[StaticDecode], torch.Tensor],
        device: torch.device,
        block_size: int,
        max_blocks: int,
        batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
        graph_type: Callable[[object], BaseGraph] | None = None,
        verify_forward: Callable[[StaticDecode], torch.Tensor] | None = None,
        max_queries: int = 1,
    ) -> None:
        if graph_type is None and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"CUDA graph batch sizes must be positive, got {list(batch_sizes)}")
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._forward = forward
        self._verify_forward = verify_forward
        self.max_queries = max_queries if verify_forward is not None else 1
        self._device = device
        self._graph_type = graph_type or TorchCudaGraph
        self._pool = torch.cuda.graph_pool_handle() if graph_type is None else None
        self._pinned = device.type == "cuda"
        self._graphs: dict[GraphKey, _Captured] = {}
        self.num_replays = 0

    @property
    def captured(self) -> list[GraphKey]:
        return list(self._graphs)

    def run(self, chunks: Sequence[ScheduledChunk], fed: FedTokens | None = None) -> torch.Tensor | None:
        """The step's logits ``[sum of num_sampled, vocab]`` (float32, chunk order, as
        ``ModelRunner.execute``) from a graph, or None when this step must run eagerly.
        ``fed``: the input tokens come from the device."""
        key = graph_key(chunks, self.block_size, self.batch_sizes, self.max_blocks, self.max_queries)
        if key is None:
            return None
        # pinned on CUDA: the copy is queued behind a step still in flight, not waited for
        inputs = decode_inputs(chunks, key, self.block_size, fed)
        host = torch.tensor(inputs, dtype=torch.int64, pin_memory=self._pinned)
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._capture(key, host, fed)
            if captured is None:  # a verify graph that cannot be captured: verify steps run eagerly
                return None
        else:
            _fill(captured.static, host, fed)
            captured.graph.replay()
        self.num_replays += 1
        nq = key.num_queries  # the next replay overwrites the static output: a copy is returned
        if nq == 1:
            return captured.logits[: len(chunks)].clone()
        rows = [i * nq + q for i, c in enumerate(chunks) for q in range(c.num_sampled)]
        return captured.logits.index_select(0, on_device(rows, self._device))

    def replay_again(self, key: GraphKey) -> None:
        """Replay ``key``'s graph on its last step's inputs once more: the device's step alone,
        for a benchmark to time (a decode key's rewrites that step's K/V into the same slots, the
        same values; a verify key's may write proposals' slots given back since)."""
        self._graphs[key].graph.replay()

    def _capture(self, key: GraphKey, host: torch.Tensor, fed: FedTokens | None) -> _Captured | None:
        """Capture ``key``'s graph on this step's inputs; warm-up runs and the replay below
        write this step's K/V into its own slots, the same values each time. A verify graph that
        fails to capture turns verify graphs off (None: this step runs eagerly, rewriting them)."""
        static = StaticDecode(key, self.block_size, self._device)
        _fill(static, host, fed)
        graph = self._graph_type(self._pool)
        forward = self._forward if key.num_queries == 1 else self._verify_forward
        try:
            logits = graph.capture(lambda: forward(static))
        except Exception:
            if key.num_queries == 1:
                raise
            logger.warning("verify steps run eagerly: their CUDA graph failed to capture", exc_info=True)
            self._verify_forward, self.max_queries = None, 1
            return None
        captured = _Captured(static, graph, logits)
        graph.replay()  # capture records the kernels without running them
        self._graphs[key] = captured
        return captured


def _fill(static: StaticDecode, host: torch.Tensor, fed: FedTokens | None) -> None:
    """Copy a step's inputs into a graph's static buffer; ``fed``: then swap the row indices in
    the token ids' place for the tokens there (on the device, nothing read back)."""
    static.inputs.copy_(host, non_blocking=True)
    if fed is not None:
        static.token_ids.copy_(fed.gather(static.token_ids))
