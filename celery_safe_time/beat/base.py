"""What both safe schedulers share: the lease and its keeper thread, startup checks, the banner,
Redis errors during a tick, and a clean exit on SIGTERM under ``worker -B``.

``LeasedScheduler`` is mixed in before a Celery ``Scheduler`` class: :class:`.SafeScheduler` here
and ``contrib.django``'s ``SafeDatabaseScheduler`` over django-celery-beat.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from celery import Celery, platforms
from celery import signals as celery_signals

from .. import constants as C
from ..checks import check_redis
from ..clock import RedisClock
from ..config import SafeTimeConfig, get_config, mask_url
from ..exceptions import ImproperlyConfigured, RedisUnavailable
from ..redis_client import get_redis, tls_hint
from .leader import LeaderKeeper
from .lease import Lease, LeaseKeys, load_state

logger = logging.getLogger(__name__)

#: Per-entry misfire policy: ``options={"safe_time_misfire": ...}`` (headers JSON on django-celery-beat rows).
OPTION_MISFIRE = "safe_time_misfire"

#: What a tick may raise when Redis fails; the scheduler then stands by (fail closed).
REDIS_ERRORS = (redis.RedisError, RedisUnavailable)


def tick_granularity(max_interval: float) -> float:
    return min(float(max_interval), C.BEAT_TICK_CAP)


def check_lease(config: SafeTimeConfig, granularity: float) -> None:
    minimum = C.BEAT_MIN_LEASE_TICKS * granularity
    if config.beat_lease < minimum:
        raise ImproperlyConfigured(
            "safe_time_beat_lease",
            f"{config.beat_lease:g} s is shorter than {C.BEAT_MIN_LEASE_TICKS} x the beat tick "
            f"({granularity:g} s); use at least {minimum:g} s",
        )


def startup_checks(config: SafeTimeConfig, client: redis.Redis, clock: RedisClock, who: str) -> None:
    """Fail loudly when Redis is unreachable; warn about persistence and eviction."""
    try:
        offset = clock.sync()
    except RedisUnavailable as exc:
        hint = tls_hint(config.redis_url, exc)
        if hint is not None:
            raise ImproperlyConfigured("safe_time_redis_url", f"{who}: {hint}") from exc
        raise RedisUnavailable(f"{who}: Redis {mask_url(config.redis_url)} is unreachable at startup: {exc}") from exc
    if abs(offset.offset) > config.max_clock_skew:
        logger.warning(
            "%s: this host's clock is %+.3f s off Redis TIME; beat uses Redis TIME, so it still fires on time",
            who,
            offset.offset,
        )
    for check in check_redis(config, client):
        if check.status != "ok" and check.name in (
            "redis_persistence",
            "redis_eviction",
            "redis_replication",
            "redis_config",
        ):
            logger.warning("%s: %s: %s", who, check.name, check.detail)


def beat_info(config: SafeTimeConfig, keeper: LeaderKeeper, client: redis.Redis, started: bool) -> str:
    """The banner line: this beat's role once running, else who holds the lease right now."""
    if started:
        state = f"leader (epoch {keeper.epoch})" if keeper.is_leader else "standby"
    else:
        try:
            holder = load_state(client.get(LeaseKeys.for_config(config).info))
            state = (
                f"lease held by {holder.get('host')} pid {holder.get('pid')} (epoch {holder.get('epoch')}): standby"
                if holder
                else "lease free: this beat will take it"
            )
        except redis.RedisError as exc:
            state = f"Redis unreachable ({exc})"
    return (
        f"    . safe-time -> {state}; lease {config.beat_lease:g}s, renewed every {config.beat_renew_interval:g}s; "
        f"redis {mask_url(config.redis_url)}"
    )


class LeasedScheduler:
    """What both safe schedulers share: the lease, its keeper thread, the banner and shutdown.

    Mixed in before a Celery ``Scheduler`` class; ``init_lease`` runs before that class's
    ``__init__`` (which calls ``setup_schedule``), ``start_lease`` at the end of ``setup_schedule``.
    """

    app: Celery
    max_interval: float

    def init_lease(self, app: Celery) -> None:
        self.config = get_config(app)
        self.client = get_redis(self.config.redis_url)
        self.clock = RedisClock(self.client)
        self.lease = Lease(self.client, self.config)
        self.keeper = LeaderKeeper(self.lease, self.clock, self.config, sender=self)
        self._closed = False
        self._started = False

    @property
    def granularity(self) -> float:
        return tick_granularity(self.max_interval)

    def check_startup(self, granularity: float) -> None:
        check_lease(self.config, granularity)
        startup_checks(self.config, self.client, self.clock, "beat")
        from ..delays.install_check import not_installed_message, sweep_installed

        if not sweep_installed(self.app):
            logger.error("beat: %s", not_installed_message(self.app))

    def start_lease(self) -> None:
        self.keeper.start()
        self._started = True
        logger.info("beat: %s", self.info.strip(" ."))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.keeper.stop(release=True)
        super().close()  # type: ignore[misc]

    @property
    def info(self) -> str:
        return beat_info(self.config, self.keeper, self.client, started=self._started)

    def redis_failed(self, exc: Exception) -> float:
        """A tick hit a Redis error: stand by until the keeper takes the lease again."""
        logger.error("beat: Redis error during tick, standing by: %s", exc)
        self.keeper.step_down(f"Redis error during tick: {exc}")
        return self.granularity


def _release_on_sigterm(sender: Any = None, **kwargs: Any) -> None:
    """In ``worker -B`` the worker stops its beat process with SIGTERM, which by default kills it
    on the spot, lease held, and the standbys wait a whole lease. Exit cleanly instead: beat's
    loop then closes the scheduler, which deletes the lease."""
    scheduler = getattr(sender, "scheduler", None)
    if getattr(scheduler, "keeper", None) is None:
        return

    def _exit(*args: Any) -> None:
        raise SystemExit()

    platforms.signals["TERM"] = _exit


celery_signals.beat_embedded_init.connect(_release_on_sigterm, weak=False)
