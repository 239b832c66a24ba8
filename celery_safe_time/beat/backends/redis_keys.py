"""The beat's Redis key names (:class:`BeatKeys`), one shard's (``safe_time_beat_shards``) at a time."""

from __future__ import annotations

import dataclasses

from ... import constants as C
from ...config import SafeTimeConfig

__all__ = ["BeatKeys"]


@dataclasses.dataclass(frozen=True)
class BeatKeys:
    """The beat's Redis keys: the lease's (lease, epoch, leader info, state hash, due set) and the runtime
    entries' (definitions, change counter and log, run-now requests, applied marker, pause expiries)."""

    lease: str
    epoch: str
    info: str
    state: str
    due: str
    entries: str
    version: str
    changed: str
    run_now: str
    applied: str
    pause_expiry: str
    names: str
    names_version: str

    @classmethod
    def for_config(cls, config: SafeTimeConfig, shard: int = 0) -> BeatKeys:
        """The keys of ``shard`` (0: the keys one leader always used; see ``KEY_BEAT_SHARD_NAMESPACE``)."""
        namespace = C.KEY_BEAT_SHARD_NAMESPACE.format(shard=shard)

        def own(template: str) -> str:
            return config.key(template if shard == 0 else namespace + template[len(C.KEY_BEAT_NAMESPACE) :])

        return cls(
            lease=own(C.KEY_BEAT_LEASE),
            epoch=own(C.KEY_BEAT_EPOCH),
            info=own(C.KEY_BEAT_LEADER_INFO),
            state=own(C.KEY_BEAT_STATE),
            due=own(C.KEY_BEAT_DUE),
            entries=config.key(C.KEY_BEAT_ENTRIES),
            version=config.key(C.KEY_BEAT_ENTRIES_VERSION),
            changed=config.key(C.KEY_BEAT_ENTRIES_CHANGED),
            run_now=config.key(C.KEY_BEAT_RUN_NOW),
            applied=own(C.KEY_BEAT_ENTRIES_APPLIED),
            pause_expiry=own(C.KEY_BEAT_PAUSE_EXPIRY),
            names=config.key(C.KEY_BEAT_ENTRIES_NAMES),
            names_version=config.key(C.KEY_BEAT_ENTRIES_NAMES_VERSION),
        )
