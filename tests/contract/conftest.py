"""Store fixture of the contract suite."""

from __future__ import annotations

from tests.helpers.delays import any_store

__all__ = ["any_store"]
