"""The NIXL agent behind a lock, and the progress thread that posts and completes transfers.

On CPU memory UCX copies inside ``transfer()`` itself (with the GIL released): a post
from the engine thread would stop the forward pass for the whole copy. So layer pushes go
through this thread, where the copy overlaps the next layer's compute.

A READ its caller awaits anyway (a pull) is posted by the caller itself (``read_inline``):
on GPU memory ``transfer()`` only posts; on CPU memory the copy runs in the caller (in
the post, and what UCX left unfinished there in the caller's polls after it), and its
future is complete on return. That is two thread hand-offs fewer on the TTFT path,
and on CPU a copy run in a helper thread while the caller waits took longer than the same
copy in the caller. The cost: on CPU the caller's event loop is blocked for the copy; the
engine steps on its own thread meanwhile, so only the delivery of other requests' tokens
on that replica waits. The figures: ``docs/benchmarks/kv_transfer_probes.md``.

The thread polls in-flight transfers and notifications 0.1 ms apart while
transfers are in flight, ``notice_poll_s`` (default 1 ms) while the owner waits for a
notice, 5 ms when idle (50 ms after a second of it, until ``expect``, a post or a deferred
notice wakes it), and completes ``concurrent.futures.Future``s that the event loop
awaits, so nothing spins on the engine's event loop. A notice cannot wake this thread:
NIXL 1.5's Python API has no blocking or callback form of ``get_new_notifs`` and exposes no
file descriptor of UCX's worker to wait on (``nixl_agent``: ``get_new_notifs``,
``update_notifs`` and ``check_remote_xfer_done`` all poll, and each call is also what
progresses UCX, since NIXL's own progress thread is off, see ``__init__``), so a notice is
seen at the next poll; ``notice_poll_s`` trades that delay against a core's time.

On CUDA a post waits for its layer's event here (``PostQueue``): only ``query()``, never a
synchronize of the event, the stream or the device.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kv_transport.base import KVTransferError, KVTransferTimeout
from kv_transport.descriptors import Descs

logger = logging.getLogger(__name__)

BUSY_POLL_S = 0.0001  # transfers in flight
WAIT_POLL_S = 0.001  # only waiting for a notice
# UCX turns cuda_ipc's GET off where it finds no NVLink, and a READ of GPU memory then goes by
# TCP at under 1 GB/s instead of a device copy (docs/benchmarks/gpu.md); a user's own setting wins
UCX_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
IDLE_POLL_S = 0.005
# after this long with nothing in flight, queued or expected, the thread polls this far
# apart: an idle replica's polls cost a few percent of a core at IDLE_POLL_S; whatever
# gives it work (a post, an export or a destination, a deferred notice) wakes it at once
IDLE_BACKOFF_AFTER_S = 1.0
IDLE_SLOW_POLL_S = 0.05
INLINE_LOCK_WAIT_S = 0.002
# an inline READ that UCX did not finish within the post is polled this long by its caller
# (as a raw NIXL READ is) before the progress thread takes over
INLINE_POLL_S = 0.0005
# ... and, between CPU memories, this much longer per byte: there UCX copies (CMA) inside
# the progress calls, so a READ it left unfinished in the post advances only while polled
# (handed to the progress thread after INLINE_POLL_S, some 16 MB pulls took longer). 1 GB/s
# is far below any copy rate seen, so the bound only cuts off a transfer that is stuck
# (figures: docs/benchmarks/kv_transfer_probes.md).
INLINE_CPU_POLL_S_PER_BYTE = 1e-9


class LayerEvent(Protocol):
    """A point in a compute stream's work (``torch.cuda.Event``; tests use a fake): recorded on
    the current stream after a layer's kernels, then asked whether it has completed."""

    def record(self) -> None: ...

    def query(self) -> bool: ...


@dataclass
class PostedAt:
    """When the progress thread posted a transfer (unix s; None until then): push layer timings."""

    unix_s: float | None = None


@dataclass
class Post:
    """One transfer to start: ``future`` gets ``(state, done time)`` or a ``KVTransferError``."""

    op: str
    local: Descs
    remote: Descs
    peer_agent: str
    peer_engine: str
    remote_mem_type: str
    request_id: str
    future: concurrent.futures.Future
    posted_at: PostedAt | None = None  # set when posted
    event: LayerEvent | None = None  # CUDA: post only once this event has completed
    deadline: float | None = None  # unix s: not posted by then, it fails (the blocks may be reused)


class PostQueue:
    """Transfers waiting for the progress thread, in the order they were queued.

    Invariant: a transfer is posted only once its event (layer i's compute, or the staging
    copy after it) has completed, and never before one queued earlier: the head holds the
    queue. So a push's layers are posted in layer order whatever order their events complete
    in, and a READ queued behind a layer waits for it. Completion is asked with ``query()``
    alone: nothing here waits on the device. Appended from any thread, popped by one.
    """

    def __init__(self) -> None:
        self._posts: collections.deque[Post] = collections.deque()

    def __bool__(self) -> bool:
        return bool(self._posts)

    def __len__(self) -> int:
        return len(self._posts)

    def append(self, post: Post) -> None:
        self._posts.append(post)

    def pop_ready(self) -> list[Post]:
        """Remove and return the posts now due: the longest head run whose events have completed."""
        ready: list[Post] = []
        while self._posts:
            head = self._posts[0]
            if head.event is not None and not head.event.query():
                break
            ready.append(self._posts.popleft())
        return ready


@dataclass
class _InFlight:
    handle: object
    future: concurrent.futures.Future


class NixlWorker:
    def __init__(self, name: str, local_mem_type: str = "DRAM", notice_poll_s: float = WAIT_POLL_S) -> None:
        from nixl._api import nixl_agent, nixl_agent_config, nixlBind

        # No NIXL progress thread: nixl's Python agent runs it with a zero delay, a thread
        # that spins a whole core per process. This thread progresses UCX instead (each
        # get_new_notifs / check_xfer_state call does), at the poll intervals above.
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        for key, value in UCX_DEFAULTS.items():  # read by UCX when an agent makes its context
            os.environ.setdefault(key, value)
        self.agent = nixl_agent(name, config)
        # Notices (release, push done, push failed) go between a second pair of agents. Once
        # a notice has gone over the connection that carries the data, UCX completes the
        # next transfer on it only after a round trip with the peer, that is at the peer's
        # next progress call: a pull would wait for the peer's poll interval
        # (figures: docs/benchmarks/kv_transfer_probes.md).
        self.notices = nixl_agent(f"{name}.notices", config)
        self.local_mem_type = local_mem_type
        self.notice_poll_s = notice_poll_s
        self.cuda_device: int | None = None  # the pool's GPU; None for a CPU pool
        self._bound = threading.local()  # per thread: the device made current there
        # descriptor lists built by the binding itself: ``get_xfer_descs`` only dispatches on
        # the input's type, a measurable cost on a pull's critical path
        # (docs/benchmarks/kv_transfer_probes.md)
        self._xfer_dlist = nixlBind.nixlXferDList
        self._segments = self.agent.nixl_mems
        # reentrant: a push's done notice goes from the callback of its last WRITE's future,
        # which may run inside ``_start`` (the lock held) when UCX finished it within the post
        self.lock = threading.RLock()
        self._outbox = PostQueue()
        # work a pull leaves for this thread: handles of READs that ended inline, notices
        # (deque appends are atomic; nothing is woken, a round comes within IDLE_POLL_S)
        self._releases: collections.deque[object] = collections.deque()
        self._notices_out: collections.deque[tuple[str, bytes]] = collections.deque()
        self._in_flight: list[_InFlight] = []
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._slow = False  # the thread polls IDLE_SLOW_POLL_S apart: deferred work must wake it
        # None: never slower than IDLE_POLL_S (a peer that serves reads it is never told of)
        self.idle_backoff_after_s: float | None = IDLE_BACKOFF_AFTER_S
        self._thread: threading.Thread | None = None

    def start(
        self, on_notif: Callable[[bytes], None], on_tick: Callable[[float], None], waiting: Callable[[], bool]
    ) -> None:
        """Run the progress thread: ``on_notif`` per notice, ``on_tick(now)`` per round."""
        self._thread = threading.Thread(
            target=self._loop, args=(on_notif, on_tick, waiting), name=f"nixl-{self.agent.name}", daemon=True
        )
        self._thread.start()

    def bind_cuda(self) -> None:
        """Make ``cuda_device`` current in the calling thread, once per thread (see the module
        docstring); a no-op for a CPU pool. Cheap after the first call: a pull calls it."""
        if self.cuda_device is None or getattr(self._bound, "device", None) == self.cuda_device:
            return
        torch.cuda.set_device(self.cuda_device)  # may skip cudaSetDevice when already "current"
        # the thread's first runtime call that needs a context makes the device's primary
        # context current in it; a stream query is one that never waits
        torch.cuda.current_stream(self.cuda_device).query()
        self._bound.device = self.cuda_device

    def stop(self) -> None:
        self._closed.set()
        self._wake.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=1)
        with self.lock:  # a release notice queued just before the stop still goes
            self._flush_deferred()

    def post(self, post: Post) -> concurrent.futures.Future:
        self._outbox.append(post)
        self._wake.set()
        return post.future

    def read_inline(
        self,
        local: Descs,
        remote: Descs,
        peer_agent: str,
        peer_engine: str,
        remote_mem_type: str,
        request_id: str,
        deadline: float | None = None,
    ) -> tuple[str, float] | concurrent.futures.Future:
        """Post a READ from the calling thread (see the module docstring) and poll it a little.

        Returns ``(state, done time)`` when it ended here, else a future that the progress
        thread completes as ``post``'s (also when that thread is busy and the READ is queued
        for it: then it is not posted after ``deadline``, the lease's end, when the caller has
        stopped holding the blocks it lands in). Nothing is allocated for a READ that ends here,
        and its handle is released by the progress thread: this is a pull's critical path.
        """
        self.bind_cuda()
        # keep posting order; wait out a polling round, never a long post of the progress thread
        if self._outbox or not self.lock.acquire(timeout=INLINE_LOCK_WAIT_S):
            post = Post(
                "READ",
                local,
                remote,
                peer_agent,
                peer_engine,
                remote_mem_type,
                request_id,
                concurrent.futures.Future(),
                deadline=deadline,
            )
            return self.post(post)
        try:
            state, handle = self._transfer(
                "READ", local, remote, peer_agent, remote_mem_type, request_id, peer_engine, keep_handle=True
            )
            if state == "PROC":  # posted but not finished in the post: poll it a little
                budget = INLINE_POLL_S
                if self.local_mem_type == "DRAM" and remote_mem_type == "DRAM":
                    budget += INLINE_CPU_POLL_S_PER_BYTE * _total_bytes(local)
                deadline = time.perf_counter() + budget
                while state == "PROC" and time.perf_counter() < deadline:
                    state = self._state(handle)
                if state == "PROC":
                    future: concurrent.futures.Future = concurrent.futures.Future()
                    self._in_flight.append(_InFlight(handle, future))
            if state != "PROC":
                self._releases.append(handle)
                self._wake_if_slow()
        finally:
            self.lock.release()
        if state == "PROC":
            self._wake.set()  # the progress thread polls it to completion
            return future
        if state == "ERR":
            raise KVTransferError("NIXL READ ended in state ERR", request_id, peer_engine)
        return state, time.time()

    def _state(self, handle: object) -> str:
        """``check_xfer_state`` (``self.lock`` held); NIXL raises for a failed transfer (e.g.
        the peer is gone): that is ``"ERR"`` here, so the transfer's waiter gets the typed
        error and the progress thread goes on with the others."""
        try:
            return self.agent.check_xfer_state(handle)
        except Exception as exc:  # e.g. the peer died: expected, one line
            logger.warning("NIXL transfer failed: %r", exc)
            return "ERR"

    def _retire(self, xfer: _InFlight) -> None:
        """Drop a finished transfer's handle (``self.lock`` held)."""
        self._in_flight.remove(xfer)
        self._release(xfer.handle)

    def _release(self, handle: object) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:  # a failed transfer's handle; nothing more to do with it
            logger.warning("could not release a NIXL transfer handle", exc_info=True)

    def add_peer(self, metadata: bytes, notice_metadata: bytes) -> tuple[str, str]:
        """Load a peer's two agents (``self.lock`` held); their names, data agent first."""
        name = self.agent.add_remote_agent(metadata)
        try:
            notice_name = self.notices.add_remote_agent(notice_metadata)
        except Exception:
            self.agent.remove_remote_agent(name)
            raise
        return tuple(n.decode() if isinstance(n, bytes) else n for n in (name, notice_name))

    def remove_peer(self, name: str, notice_name: str) -> None:
        """Forget a peer's agents (``self.lock`` held), after what pulls left for it."""
        self._flush_deferred()
        self.agent.remove_remote_agent(name)
        self.notices.remove_remote_agent(notice_name)

    def notify(self, peer_notice_agent: str, message: bytes) -> None:
        """Best effort: a peer that is gone cannot be told, and its side times out."""
        with self.lock:
            self._send_notice(peer_notice_agent, message)

    def notify_soon(self, peer_notice_agent: str, message: bytes) -> None:
        """``notify`` from the progress thread's next round (within ``IDLE_POLL_S``): costs the
        caller one append (a pull's release notice, sent after the copy). Once the thread is
        stopped, at once."""
        if self._closed.is_set():
            self.notify(peer_notice_agent, message)
        else:
            self._notices_out.append((peer_notice_agent, message))
            self._wake_if_slow()

    def expect(self) -> None:
        """The owner now expects a peer (an export to be read, a destination to be written):
        poll at the waiting pace from now on, not the slow idle one."""
        self._wake.set()

    def _wake_if_slow(self) -> None:
        if self._slow:
            self._wake.set()

    def _send_notice(self, peer_notice_agent: str, message: bytes) -> None:
        try:
            self.notices.send_notif(peer_notice_agent, message)
        except Exception:
            logger.warning("could not notify %s (%s)", peer_notice_agent, message[:40])

    def _loop(self, on_notif, on_tick, waiting) -> None:
        self.bind_cuda()
        idle_since: float | None = None
        while not self._closed.is_set():
            try:
                interval = self._round(on_notif, on_tick, waiting)
            except Exception:  # keep the thread alive; each failure is logged
                logger.exception("NIXL progress loop error")
                interval = IDLE_POLL_S
            if interval != IDLE_POLL_S:
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif self.idle_backoff_after_s is not None and time.monotonic() - idle_since > self.idle_backoff_after_s:
                interval = IDLE_SLOW_POLL_S
            self._slow = interval == IDLE_SLOW_POLL_S
            self._wake.wait(interval)
            self._wake.clear()
            self._slow = False

    def _round(self, on_notif, on_tick, waiting) -> float:
        """Post what is queued, complete what finished, deliver notices; returns the next wait."""
        if self._releases or self._notices_out:  # first: a long post must not hold them back
            with self.lock:
                self._flush_deferred()
        self._drain_outbox()
        finished: list[tuple[_InFlight, str]] = []
        with self.lock:
            try:
                notifs = self.notices.get_new_notifs()
                self.agent.get_new_notifs()  # progresses the data agent (connection setup)
            except Exception:  # delivered next round; transfers and expiry go on meanwhile
                logger.warning("NIXL notices could not be read", exc_info=True)
                notifs = {}
            for xfer in list(self._in_flight):
                state = self._state(xfer.handle)
                if state != "PROC":
                    self._retire(xfer)
                    finished.append((xfer, state))
        now = time.time()
        for xfer, state in finished:
            if not xfer.future.done():
                xfer.future.set_result((state, now))
        for messages in notifs.values():
            for message in messages:
                on_notif(message)
        on_tick(now)
        if self._in_flight or self._outbox:
            return BUSY_POLL_S
        return self.notice_poll_s if waiting() else IDLE_POLL_S

    def _flush_deferred(self) -> None:
        """Release handles and send notices that pulls left (``self.lock`` held)."""
        while self._releases:
            self._release(self._releases.popleft())
        while self._notices_out:
            self._send_notice(*self._notices_out.popleft())

    def _drain_outbox(self) -> None:
        """Post queued transfers in order; a CUDA post waits for its layer's event (``PostQueue``)."""
        for post in self._outbox.pop_ready():
            self._post_now(post)

    def _post_now(self, post: Post) -> None:
        with self.lock:
            self._start(post)

    def _start(self, post: Post) -> None:
        """Post one transfer (``self.lock`` held); one that UCX finished within the post
        completes its future here, any other joins the in-flight list."""
        if post.deadline is not None and time.time() >= post.deadline:
            what = "lease" if post.op == "READ" else "destination"
            expired = KVTransferTimeout(f"its {what} expired before the post", post.request_id, post.peer_engine)
            post.future.set_exception(expired)
            return
        if post.posted_at is not None:
            post.posted_at.unix_s = time.time()
        try:
            state, handle = self._transfer(
                post.op,
                post.local,
                post.remote,
                post.peer_agent,
                post.remote_mem_type,
                post.request_id,
                post.peer_engine,
            )
        except KVTransferError as exc:
            post.future.set_exception(exc)
            return
        if state == "PROC":
            self._in_flight.append(_InFlight(handle, post.future))
        elif state == "ERR":
            post.future.set_exception(
                KVTransferError(f"NIXL {post.op} could not be posted", post.request_id, post.peer_engine)
            )
        else:
            post.future.set_result((state, time.time()))

    def _transfer(
        self,
        op: str,
        local: Descs,
        remote: Descs,
        peer_agent: str,
        remote_mem_type: str,
        request_id: str,
        peer_engine: str,
        keep_handle: bool = False,
    ) -> tuple[str, object | None]:
        """Post one transfer (``self.lock`` held): ``("PROC", handle)`` while in flight, else
        ``(state, None)`` with the handle released (``(state, handle)`` with ``keep_handle``).
        NIXL's own errors (e.g. the peer disconnected) become ``KVTransferError``."""
        handle = None
        try:
            handle = self.agent.initialize_xfer(
                op,
                self._xfer_dlist(self._segments[self.local_mem_type], local),
                self._xfer_dlist(self._segments[remote_mem_type], remote),
                peer_agent,
            )
            state = self.agent.transfer(handle)
        except Exception as exc:
            if handle is not None:
                self._release(handle)
            raise KVTransferError(f"NIXL {op} failed: {exc!r}", request_id, peer_engine) from exc
        if state == "PROC" or keep_handle:
            return state, handle
        self._release(handle)
        return state, None


def _total_bytes(descs: Descs) -> int:
    """Bytes a descriptor list moves: a list of rows, or a ``[n, 3]`` array."""
    if isinstance(descs, list):
        return sum(length for _, length, _ in descs)
    return int(descs[:, 1].sum())
