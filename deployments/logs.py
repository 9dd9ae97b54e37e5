"""Operator-readable logs: an expected failure is one line, an unexpected one keeps its traceback.

Serve logs every exception a replica method raises as ``Request failed.`` with the whole
traceback (its logger, ``ray.serve``). Some of those are expected events of a running
service (a transfer whose peer died, a request refused by the engine, no KV room, a
replica that changed role): ``ExpectedErrors`` turns those records into one line naming the
error, which already names the request and the peer. Everything else is left as it is.
"""

from __future__ import annotations

import logging

from engine.params import FieldError, RoleError
from kv_transport.base import KVCapacityError, KVTransferError

SERVE_LOGGER = "ray.serve"  # Serve writes it to each replica's log file, with the request id
EXPECTED = (KVTransferError, KVCapacityError, FieldError, RoleError)


class ExpectedErrors(logging.Filter):
    """Drop the traceback of records whose exception is an ``EXPECTED`` type (message kept,
    the error appended on the same line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, EXPECTED):
            record.msg, record.args = f"{record.getMessage()} {type(exc).__name__}: {exc}", None
            record.exc_info, record.exc_text = None, None
        return True


def install() -> logging.Logger:
    """Put the filter on Serve's logger once per process; returns that logger (the one the
    deployments log to, so their lines land in the replica's log file)."""
    logger = logging.getLogger(SERVE_LOGGER)
    if not any(isinstance(f, ExpectedErrors) for f in logger.filters):
        logger.addFilter(ExpectedErrors())
    return logger
