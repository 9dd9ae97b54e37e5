"""Fixtures of the served tests in this package."""

from tests.deployments.keyed_app import key_file, keyed_url

__all__ = ["key_file", "keyed_url"]
