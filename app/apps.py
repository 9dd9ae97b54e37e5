"""Application objects for ``serve build`` (it needs an Application, not a builder).

``serve build app.apps:disagg -o serve.yaml`` writes a Serve config that ``serve deploy``
accepts; the applications are built from the defaults and ``TANDEM__*`` environment
variables when this module's attribute is read (so importing it stays cheap).
"""

from __future__ import annotations

from typing import Any

from app.config import colocated_app, disagg_app

_BUILDERS = {"disagg": disagg_app, "colocated": colocated_app}


def __getattr__(name: str) -> Any:
    if name in _BUILDERS:
        return _BUILDERS[name]({})
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
