"""The NIXL notices' wire format, and the errors that must keep their type through Ray."""

from __future__ import annotations

import pickle

import pytest
from ray.exceptions import RayTaskError

from engine.params import TokenLogprobs
from kv_transport import notices
from kv_transport.base import KVCapacityError, KVTransferTimeout


def test_notices_have_the_exact_wire_format():
    lp = TokenLogprobs(token_id=42, logprob=-0.25, top=((42, -0.25), (7, -2.0)))
    wire = {
        notices.ReleaseNotice(request_id="chat:1"): b"R:chat:1",
        notices.PushFailedNotice(request_id="r2"): b"F:r2",
        notices.PushFailedNotice(request_id="r:2", settled=False): b"W:r:2",
        notices.PushDoneNotice(request_id="r3", first_token=5): b'P:["r3", 5, null]',
        notices.PushDoneNotice(request_id="r:4", first_token=42, first_logprobs=lp): (
            b'P:["r:4", 42, [42, -0.25, [[42, -0.25], [7, -2.0]]]]'
        ),
    }
    for notice, message in wire.items():
        assert notices.encode(notice) == message
        assert notices.decode(message) == notice


def test_an_unknown_notice_is_refused():
    with pytest.raises(ValueError, match="unknown notice tag 'X'"):
        notices.decode(b"X:r1")


def test_capacity_and_transfer_errors_keep_their_type_through_pickling():
    capacity = pickle.loads(pickle.dumps(KVCapacityError("no room for 40 tokens")))
    assert type(capacity) is KVCapacityError and str(capacity) == "no room for 40 tokens"
    # as Ray hands it to the caller: the cause of a task error, and an instance of its type
    wrapped = pickle.loads(pickle.dumps(RayTaskError("decode_pull", "traceback", KVCapacityError("full"))))
    assert type(wrapped.cause) is KVCapacityError
    assert isinstance(wrapped.as_instanceof_cause(), KVCapacityError)
    timeout = pickle.loads(pickle.dumps(KVTransferTimeout("slow", "r1", "peer-0")))
    assert (type(timeout), timeout.request_id, timeout.peer) == (KVTransferTimeout, "r1", "peer-0")
