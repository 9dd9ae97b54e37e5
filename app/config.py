"""Entry points: ``serve run app.config:disagg_app`` and ``app.config:colocated_app``.

Builder arguments: ``config=path.yaml`` and ``section.field=value`` pairs (see
``app.settings.AppConfig`` for every setting and the order in which sources win).
"""

from __future__ import annotations

from app.settings import AppConfig

__all__ = ["AppConfig", "colocated_app", "disagg_app"]


def disagg_app(args: dict[str, str] | None = None):
    """``serve run app.config:disagg_app [config=path.yaml] [section.field=value ...]``"""
    from deployments.build import build_disagg

    return build_disagg(AppConfig.load(args))


def colocated_app(args: dict[str, str] | None = None):
    """The baseline: replicas that do both phases (``colocated.num_replicas``, default 2)."""
    from deployments.build import build_colocated

    return build_colocated(AppConfig.load(args))
