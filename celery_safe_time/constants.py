"""Every default, key name and magic number of the package, in one place.

Other modules import from here instead of repeating literals, so an operator
reading this file sees every Redis key the package writes and every default
it applies.
"""

from __future__ import annotations

from typing import Final

# --- settings defaults (DESIGN section 3) --------------------------------
DEFAULT_KEY_PREFIX: Final = "safe_time:"
DEFAULT_BEAT_LEASE: Final = 30.0
DEFAULT_MISFIRE: Final = "run_once"
DEFAULT_MISFIRE_GRACE: Final = None
DEFAULT_DELAY_THRESHOLD_CAP: Final = 900.0
DEFAULT_STORE_URL: Final = "sqlite:///celery_safe_time.sqlite3"
DEFAULT_SWEEP_INTERVAL: Final = 5.0
DEFAULT_SWEEP_BATCH: Final = 500
DEFAULT_SWEEP_QUEUE: Final = None
DEFAULT_ALLOW_PICKLE: Final = False
DEFAULT_CLAIM_TIMEOUT: Final = 300.0
DEFAULT_LOCK_TTL: Final = 60.0
DEFAULT_MAX_CLOCK_SKEW: Final = 0.1

#: kombu's own default for Redis and SQS when broker_transport_options does not set one.
KOMBU_DEFAULT_VISIBILITY_TIMEOUT: Final = 3600.0
#: Brokers whose unacked messages are redelivered after ``visibility_timeout``.
VISIBILITY_TIMEOUT_SCHEMES: Final = frozenset({"redis", "rediss", "sentinel", "sqs", "socket"})

MISFIRE_POLICIES: Final = frozenset({"run_once", "skip", "run_all"})
#: run_all never fires more than this many catch-up slots for one entry.
RUN_ALL_CAP: Final = 100

REDIS_URL_SCHEMES: Final = frozenset({"redis", "rediss", "unix", "sentinel"})
#: Store URLs accepted by safe_time_store_url, besides the literal "django".
STORE_URL_SCHEMES: Final = frozenset({"sqlite", "postgresql", "postgres", "mysql", "mariadb", "memory"})
DJANGO_STORE: Final = "django"

# --- Redis client --------------------------------------------------------
REDIS_SOCKET_TIMEOUT: Final = 5.0
REDIS_CONNECT_TIMEOUT: Final = 5.0
REDIS_HEALTH_CHECK_INTERVAL: Final = 30

# --- Redis key names (always behind safe_time_key_prefix) ----------------
KEY_BEAT_LEASE: Final = "beat:lease"
KEY_BEAT_EPOCH: Final = "beat:epoch"
KEY_BEAT_LEADER_INFO: Final = "beat:leader"
KEY_BEAT_FIRED: Final = "beat:fired:{entry}:{slot}"
KEY_BEAT_STATE: Final = "beat:state"
KEY_BEAT_DUE: Final = "beat:due"
KEY_LOCK: Final = "lock:{key}"
KEY_LOCK_FENCE: Final = "lock-fence:{key}"
KEY_IDEMPOTENT: Final = "idem:{key}"
KEY_TASK_DONE: Final = "done:{task_id}"

#: How long a fired-slot marker is kept (DESIGN: 7 days).
FIRED_SLOT_TTL: Final = 7 * 86400

# --- Message headers -----------------------------------------------------
HEADER_SLOT: Final = "safe_time_slot"
HEADER_EPOCH: Final = "safe_time_epoch"
HEADER_STORED: Final = "safe_time_stored"

# --- Tasks ---------------------------------------------------------------
SWEEP_TASK_NAME: Final = "celery_safe_time.sweep"
SWEEP_ENTRY_NAME: Final = "celery_safe_time.sweep"

#: Extra seconds a sweep looks ahead; rows due within it are published with eta=due_at.
SWEEP_LOOKAHEAD: Final = 2.0

# === beat (issue 3) ==========================================================
#: The scheduler never sleeps longer than this between ticks (a tick is two Redis reads).
BEAT_TICK_CAP: Final = 1.0
#: safe_time_beat_lease must be at least this many tick granularities.
BEAT_MIN_LEASE_TICKS: Final = 3
#: Due entries handled per tick; the next tick follows at once when more are due.
BEAT_DUE_BATCH: Final = 500
#: Seconds to wait for the lease thread on shutdown.
BEAT_RENEW_TIMEOUT: Final = 10.0
#: Most slots walked through when catching up one entry after downtime.
BEAT_CATCHUP_SCAN_LIMIT: Final = 100_000
#: Entries shown by ``celery safe-time status``.
BEAT_STATUS_ENTRIES: Final = 50


# === delays (issue 4) ========================================================


# === locks and idempotency (issue 5) =========================================
