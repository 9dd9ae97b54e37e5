"""Expected failures are one log line; unexpected ones keep their traceback."""

from __future__ import annotations

import logging

from deployments.logs import ExpectedErrors
from kv_transport.base import KVTransferError


def _record(exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        import sys

        return logging.LogRecord("ray.serve", logging.ERROR, __file__, 1, "Request failed.", None, sys.exc_info())


def test_an_expected_error_becomes_one_line():
    record = _record(KVTransferError("NIXL READ failed", "req-1", "prefill-7"))
    assert ExpectedErrors().filter(record)
    formatted = logging.Formatter().format(record)
    assert formatted == "Request failed. KVTransferError: NIXL READ failed (request req-1, peer prefill-7)"


def test_an_unexpected_error_keeps_its_traceback():
    record = _record(ZeroDivisionError("division by zero"))
    assert ExpectedErrors().filter(record)
    formatted = logging.Formatter().format(record)
    assert formatted.startswith("Request failed.\nTraceback (most recent call last):")
    assert formatted.endswith("ZeroDivisionError: division by zero")
