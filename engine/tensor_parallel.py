"""Tensor parallelism inside one engine: the model's layers split by heads over ``degree`` ranks.

Each rank holds ``heads / degree`` query heads and their KV heads (a KV head is split when
the degree divides the KV heads, else replicated on ``degree / kv_heads`` ranks, as vLLM
does), and ``intermediate / degree`` columns of the MLP: q/k/v and gate/up keep their
rank's output rows, o_proj and down_proj their input columns and sum over the ranks
(one all-reduce after each of those two products per layer). Embeddings and norms are
replicated. The LM head runs on rank 0 alone: rank 0 samples, so the logits are needed
only there, and a vocab-parallel head would add a gather of the logits to every step.

The weights are sharded here, not by transformers' ``tp_plan``: that plan shards at
``from_pretrained`` time through DTensor (our random-weight and GGUF-converted loads go
other ways), cannot replicate a KV head over several ranks, and our CPU layout
(``engine/weights.py``) replaces ``Linear.forward``. Sharding comes first, so the fused and
re-laid-out projections are each rank's own, and the all-reduce lives in ``RowParallel``,
around the inner ``Linear`` whose forward the layout replaces.

Rank 0 is the engine (``EngineCore``): it schedules, and before each forward sends the
step's plan (its ``ScheduledChunk``s) to the other ranks, which run the same forward on
their shards (``run_worker``). The plan carries everything a step needs (tokens, positions,
block tables, proposals to verify), so the workers keep no request state. The plan goes
over gloo on every device; the all-reduces over gloo on CPU and NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

HELLO_KEY = "hello/{rank}"  # a worker rank reached rank 0's store
TIMEOUT_S = 600.0  # a collective waits this long for the other ranks (startup includes loading the model)
HEARTBEAT_S = 10.0  # an idle rank 0 sends an empty plan this often: the workers' wait never times out


@dataclass(frozen=True)
class Shard:
    """Which heads and MLP columns one rank holds."""

    rank: int
    degree: int
    heads: int  # the model's query heads
    kv_heads: int
    intermediate: int

    @property
    def num_heads(self) -> int:
        return self.heads // self.degree

    @property
    def head_start(self) -> int:
        return self.rank * self.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads // self.degree if self.kv_heads % self.degree == 0 else 1

    @property
    def kv_head_start(self) -> int:
        if self.kv_heads % self.degree == 0:
            return self.rank * self.num_kv_heads
        return self.rank // (self.degree // self.kv_heads)  # replicated: degree / kv_heads ranks per KV head

    @property
    def kv_head_range(self) -> range:
        """The model's KV heads this rank's pool holds."""
        return range(self.kv_head_start, self.kv_head_start + self.num_kv_heads)

    @property
    def columns(self) -> int:
        return self.intermediate // self.degree


def model_sizes(config: object) -> tuple[int, int, int]:
    """(query heads, KV heads, MLP intermediate size) of a transformers decoder config."""
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads, config.intermediate_size


def check_degree(config: object, degree: int, field: str = "tensor_parallel_size") -> None:
    """Refuse a degree the model cannot be split by, naming ``field`` and the sizes."""
    heads, kv_heads, intermediate = model_sizes(config)
    wrong = []
    if heads % degree:
        wrong.append(f"num_attention_heads={heads}")
    if intermediate % degree:
        wrong.append(f"intermediate_size={intermediate}")
    if kv_heads % degree and degree % kv_heads:
        wrong.append(f"num_key_value_heads={kv_heads} (must be divisible by the degree or divide it)")
    if wrong:
        raise ValueError(f"{field}={degree} does not divide the model's {', '.join(wrong)}")


def shard_for(config: object, rank: int, degree: int) -> Shard:
    heads, kv_heads, intermediate = model_sizes(config)
    return Shard(rank, degree, heads, kv_heads, intermediate)


class RowParallel(nn.Module):
    """A row-parallel product: this rank's input columns, summed over the ranks, then the bias."""

    def __init__(self, linear: nn.Linear, bias: torch.Tensor | None, reduce: Callable[[torch.Tensor], None]):
        super().__init__()
        self.linear = linear
        self.register_buffer("bias", bias, persistent=False)
        self._reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x).contiguous()
        self._reduce(out)
        return out if self.bias is None else out + self.bias


def _keep_rows(linear: nn.Linear, start: int, count: int) -> None:
    with torch.no_grad():
        linear.weight = nn.Parameter(linear.weight[start : start + count].clone(), requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias[start : start + count].clone(), requires_grad=False)
    linear.out_features = count


def _row_parallel(linear: nn.Linear, start: int, count: int, reduce: Callable[[torch.Tensor], None]) -> RowParallel:
    with torch.no_grad():
        weight = linear.weight
        inner = nn.Linear(count, linear.out_features, bias=False, device=weight.device, dtype=weight.dtype)
        inner.weight = nn.Parameter(weight[:, start : start + count].clone(), requires_grad=False)
        bias = None if linear.bias is None else linear.bias.detach().clone()
    return RowParallel(inner, bias, reduce)


def shard_model(model: nn.Module, shard: Shard, reduce: Callable[[torch.Tensor], None]) -> None:
    """Cut every decoder layer down to ``shard``'s heads and columns, in place."""
    layers = getattr(model, model.base_model_prefix).layers
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) or not all(
            hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")
        ):
            raise ValueError(
                "tensor parallelism needs layers with self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj "
                f"({type(layer).__name__} has other modules)"
            )
        d = attn.head_dim
        _keep_rows(attn.q_proj, shard.head_start * d, shard.num_heads * d)
        _keep_rows(attn.k_proj, shard.kv_head_start * d, shard.num_kv_heads * d)
        _keep_rows(attn.v_proj, shard.kv_head_start * d, shard.num_kv_heads * d)
        attn.o_proj = _row_parallel(attn.o_proj, shard.head_start * d, shard.num_heads * d, reduce)
        attn.num_key_value_groups = shard.num_heads // shard.num_kv_heads
        cols = shard.columns
        _keep_rows(mlp.gate_proj, shard.rank * cols, cols)
        _keep_rows(mlp.up_proj, shard.rank * cols, cols)
        mlp.down_proj = _row_parallel(mlp.down_proj, shard.rank * cols, cols, reduce)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one engine meet: rank 0's store (same node: a TP group never spans nodes)."""

    host: str
    port: int
    degree: int


class RankGroup:
    """One rank's view of its engine's group: the plan channel (gloo) and the all-reduce."""

    def __init__(self, rank: int, rendezvous: Rendezvous, device: torch.device, store: dist.Store | None = None):
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        if store is None:
            store = dist.TCPStore(rendezvous.host, rendezvous.port, rendezvous.degree, False, timeout=timeout)
            store.set(HELLO_KEY.format(rank=rank), "")
        self.rank, self.degree = rank, rendezvous.degree
        self._store = store
        self._plan = dist.ProcessGroupGloo(dist.PrefixStore("plan", store), rank, self.degree, timeout)
        if device.type == "cuda":
            self._reduce_group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, self.degree)
        else:
            self._reduce_group = self._plan
        self.reduce_s = 0.0  # time spent in all-reduces since start (bench.tensor_parallel reads it)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        start = time.perf_counter()
        self._reduce_group.allreduce([tensor]).wait()
        self.reduce_s += time.perf_counter() - start  # communication and the wait for the other ranks

    def send(self, plan: object) -> None:
        """Rank 0: broadcast the next step (None: the workers stop)."""
        data = torch.frombuffer(bytearray(pickle.dumps(plan)), dtype=torch.uint8)
        self._plan.broadcast(torch.tensor([data.numel()], dtype=torch.int64), 0).wait()
        self._plan.broadcast(data, 0).wait()

    def receive(self) -> object:
        size = torch.zeros(1, dtype=torch.int64)
        self._plan.broadcast(size, 0).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._plan.broadcast(data, 0).wait()
        return pickle.loads(data.numpy().tobytes())

    def agree(self, ok: bool) -> list[int]:
        """Every rank says whether it is ready; returns the ranks that are not."""
        return [r for r, value in enumerate(self.gather(0 if ok else -1)) if value < 0]

    def gather(self, value: int) -> list[int]:
        """Every rank's ``value``, by rank (on every rank)."""
        values = torch.zeros(self.degree, dtype=torch.int64)
        values[self.rank] = value
        self._plan.allreduce([values]).wait()
        return values.tolist()

    def publish(self, key: str, value: str) -> None:
        """Put ``value`` in the group's store (read by ``read`` on any rank)."""
        self._store.set(key, value)

    def read(self, key: str) -> str:
        return self._store.get(key).decode()


def leader(degree: int, device: torch.device) -> tuple[Rendezvous, Callable[[Callable[[], str | None]], RankGroup]]:
    """Rank 0's rendezvous (a store on a free local port) and the call that joins the group
    once the workers are launched: it waits for every rank to reach the store, asking
    ``problem`` (the workers' ``problem``) every second, so a rank that died before it got there
    fails the start at once instead of after ``TIMEOUT_S``."""
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    host = "127.0.0.1"
    store = dist.TCPStore(host, 0, degree, True, timeout=timeout, wait_for_workers=False)
    rendezvous = Rendezvous(host, store.port, degree)

    def join(problem: Callable[[], str | None] = lambda: None) -> RankGroup:
        keys, deadline = [HELLO_KEY.format(rank=r) for r in range(1, degree)], time.monotonic() + TIMEOUT_S
        while not _reached(store, keys):
            failure = problem()
            if failure is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks did not start: {failure or 'timed out'}")
        return RankGroup(0, rendezvous, device, store)

    return rendezvous, join


def _reached(store: dist.Store, keys: list[str]) -> bool:
    """Whether every key is in ``store`` within a second."""
    try:
        store.wait(keys, datetime.timedelta(seconds=1))
    except dist.DistStoreError:
        return False
    return True
