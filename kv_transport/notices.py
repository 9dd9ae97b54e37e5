"""The NIXL notices between two engines, and their wire format (one place for both).

A notice is ``<tag>:<body>`` in bytes:

* ``R:<request id>``: consumer -> producer, release the exported blocks (pull);
* ``P:[<request id>, <first token>, <its log-probabilities or null>]`` (JSON): producer ->
  consumer, the push is complete; log-probabilities as ``[token id, logprob, [[id, logprob], ...]]``;
* ``F:<request id>``: producer -> consumer, the push failed; sent once none of its WRITEs can
  still land, so the consumer frees the blocks on it;
* ``W:<request id>``: producer -> consumer, the push failed and a WRITE of it may still land (a
  head-wise push whose WRITEs failed or timed out): the consumer stops waiting, and frees the
  blocks only once no WRITE can land (its destination's expiry and a margin).

Request ids may hold ``:``; only the first one separates the tag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.params import TokenLogprobs


@dataclass(frozen=True)
class ReleaseNotice:
    request_id: str


@dataclass(frozen=True)
class PushDoneNotice:
    request_id: str
    first_token: int
    first_logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class PushFailedNotice:
    request_id: str
    settled: bool = True  # none of the push's WRITEs can still land


Notice = ReleaseNotice | PushDoneNotice | PushFailedNotice


def encode(notice: Notice) -> bytes:
    if isinstance(notice, ReleaseNotice):
        return b"R:" + notice.request_id.encode()
    if isinstance(notice, PushFailedNotice):
        return (b"F:" if notice.settled else b"W:") + notice.request_id.encode()
    lp = notice.first_logprobs
    logprobs = None if lp is None else [lp.token_id, lp.logprob, lp.top]
    return b"P:" + json.dumps([notice.request_id, notice.first_token, logprobs]).encode()


def decode(message: bytes) -> Notice:
    """The notice in ``message``; ``ValueError`` for an unknown tag or a malformed body."""
    tag, _, body = message.decode().partition(":")
    if tag == "R":
        return ReleaseNotice(request_id=body)
    if tag in ("F", "W"):
        return PushFailedNotice(request_id=body, settled=tag == "F")
    if tag == "P":
        request_id, token, logprobs = json.loads(body)
        first_logprobs = None
        if logprobs is not None:
            token_id, logprob, top = logprobs
            first_logprobs = TokenLogprobs(token_id=token_id, logprob=logprob, top=tuple((t, p) for t, p in top))
        return PushDoneNotice(request_id=request_id, first_token=token, first_logprobs=first_logprobs)
    raise ValueError(f"unknown notice tag {tag!r}")
