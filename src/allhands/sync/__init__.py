"""How workers reconcile their updates. One module per strategy; the loop sees only this API."""

from __future__ import annotations

from allhands.sync.allreduce import AllReduceSync
from allhands.sync.base import SyncStrategy

STRATEGIES = {"allreduce": AllReduceSync}


def build_sync(name: str, **options) -> SyncStrategy:
    return STRATEGIES[name](**options)


__all__ = ["AllReduceSync", "SyncStrategy", "build_sync", "STRATEGIES"]
