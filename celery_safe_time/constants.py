"""Wire identifiers and user-facing defaults, in one place.

Here: the defaults of the ``safe_time_*`` settings, every Redis key and message header the package
writes, table, index and advisory-lock names shared between processes and versions, and the values
several modules share (statuses, policies). A tuning knob that one module uses is defined in that
module, next to the code it tunes.
"""

from __future__ import annotations

from typing import Final, Literal

# === settings defaults ========================================================
DEFAULT_KEY_PREFIX: Final = "safe_time:"
DEFAULT_BEAT_LEASE: Final = 30.0
#: ``safe_time_beat_shards``: 1 is one leader for every entry.
DEFAULT_BEAT_SHARDS: Final = 1
DEFAULT_MISFIRE: Final = "run_once"
DEFAULT_MISFIRE_GRACE: Final = None
DEFAULT_DELAY_THRESHOLD_CAP: Final = 900.0
DEFAULT_STORE_URL: Final = "sqlite:///celery_safe_time.sqlite3"
#: ``safe_time_store_namespace`` when the app has no main name (``Celery()``); otherwise the default
#: is the app's main name (``Celery("proj")`` -> ``"proj"``).
DEFAULT_STORE_NAMESPACE: Final = "celery"
#: The namespace of rows a store built by hand (no app) writes: every app's sweep, listing and count
#: includes them.
SHARED_STORE_NAMESPACE: Final = ""
DEFAULT_SWEEP_INTERVAL: Final = 5.0
DEFAULT_SWEEP_BATCH: Final = 500
DEFAULT_SWEEP_QUEUE: Final = None
DEFAULT_ALLOW_PICKLE: Final = False
DEFAULT_CLAIM_TIMEOUT: Final = 300.0
DEFAULT_LOCK_TTL: Final = 60.0
DEFAULT_MAX_CLOCK_SKEW: Final = 0.1
#: Finished delay rows are kept forever unless ``safe_time_delay_retention`` sets an age.
DEFAULT_DELAY_RETENTION: Final = None
#: A row published (``sent``) but not started this long after its due time is published again.
DEFAULT_DELIVERY_GRACE: Final = 300.0
#: Every setting of the package starts with this; an unknown one is warned about at startup.
SETTING_PREFIX: Final = "safe_time_"
#: Settings of this package that are not Celery's: Django's ``SAFE_TIME_CELERY_APP`` (the app the
#: admin reads). A project loading its Django settings without a namespace puts it on ``app.conf``,
#: where it is known, not a misspelling.
DJANGO_APP_SETTING: Final = "SAFE_TIME_CELERY_APP"

#: kombu's own default for Redis when broker_transport_options does not set one.
KOMBU_DEFAULT_VISIBILITY_TIMEOUT: Final = 3600.0
#: kombu's SQS transport defaults to 30 minutes instead (``Channel.default_visibility_timeout``).
KOMBU_SQS_DEFAULT_VISIBILITY_TIMEOUT: Final = 1800.0
#: Brokers whose unacked messages are redelivered after ``visibility_timeout``.
VISIBILITY_TIMEOUT_SCHEMES: Final = frozenset({"redis", "rediss", "sentinel", "sqs", "socket"})

# --- broker kinds (``safe-time check`` reports them; the threshold rules follow them) ---
BROKER_AMQP: Final = "amqp"
BROKER_REDIS: Final = "redis"
BROKER_SQS: Final = "sqs"
BROKER_OTHER: Final = "other"
#: broker_url schemes that speak AMQP 0-9-1 to RabbitMQ (kombu's aliases included).
AMQP_SCHEMES: Final = frozenset({"amqp", "amqps", "pyamqp", "librabbitmq"})
REDIS_BROKER_SCHEMES: Final = frozenset({"redis", "rediss", "sentinel", "socket"})
#: RabbitMQ closes a channel whose delivery stays unacked longer than ``consumer_timeout`` (30 minutes
#: by default since 3.8.17) and Celery's worker exits ("Unrecoverable error: PreconditionFailed").
#: Celery holds an ETA message unacked until it is due, so every broker countdown must stay below it.
DEFAULT_AMQP_CONSUMER_TIMEOUT: Final = 1800.0
#: SQS limits: a message's ``DelaySeconds`` is at most 15 minutes, a visibility timeout at most 12 hours.
SQS_MAX_DELAY_SECONDS: Final = 900.0
SQS_MAX_VISIBILITY_TIMEOUT: Final = 43200.0
#: SQS's message size limit (a queue's default ``MaximumMessageSize``): a larger message is refused at publish.
SQS_MAX_MESSAGE_BYTES: Final = 262144

MISFIRE_POLICIES: Final = frozenset({"run_once", "skip", "run_all"})
#: run_all never fires more than this many catch-up slots for one entry.
RUN_ALL_CAP: Final = 100

REDIS_URL_SCHEMES: Final = frozenset({"redis", "rediss", "unix", "sentinel", "redis+cluster", "rediss+cluster"})
#: ``safe_time_redis_url`` schemes that talk to a Redis Cluster (redis-py's ``RedisCluster``).
REDIS_CLUSTER_SCHEMES: Final = frozenset({"redis+cluster", "rediss+cluster"})
#: ``safe_time_coordination_url``: where the beat lease, fired slots, schedule state, overlap locks,
#: idempotency markers and unique keys live. Unset: Redis (``safe_time_redis_url``).
COORDINATION_REDIS: Final = "redis"
COORDINATION_POSTGRES: Final = "postgres"
#: ``safe_time_coordination_url = "store"``: the delay store's own PostgreSQL database.
COORDINATION_STORE: Final = "store"
COORDINATION_POSTGRES_SCHEMES: Final = frozenset({"postgresql", "postgres"})
#: Connections one process keeps for coordination (beat: the lease thread and the tick; a worker: its
#: pool's threads); a session advisory lock holds one more for the length of a run.
COORDINATION_POOL_SIZE: Final = 4
COORDINATION_POOL_OVERFLOW: Final = 8
#: PostgreSQL lock tables (``locks/backends/postgres.py``): held locks, markers (idempotency markers
#: and finished deliveries) and unique keys; fencing numbers come from one sequence that never restarts.
PG_LOCK_TABLE: Final = "safe_time_lock"
PG_LOCK_MARKER_TABLE: Final = "safe_time_lock_marker"
PG_UNIQUE_TABLE: Final = "safe_time_unique"
#: How PostgreSQL overlap locks are held: ``lease`` (a row with an expiry on the database clock,
#: renewed by the watchdog; the default) or ``session`` (``pg_try_advisory_lock`` on a connection held
#: for the run, freed by the server when that connection dies; not behind PgBouncer in transaction mode).
PG_LOCK_MODE_LEASE: Final = "lease"
PG_LOCK_MODE_SESSION: Final = "session"
PG_LOCK_MODES: Final = (PG_LOCK_MODE_LEASE, PG_LOCK_MODE_SESSION)

#: Store URLs accepted by safe_time_store_url, besides the literal "django".
STORE_URL_SCHEMES: Final = frozenset({"sqlite", "postgresql", "postgres", "mysql", "mariadb", "memory"})
DJANGO_STORE: Final = "django"

# === connections ==============================================================
#: Seconds a connection to the store or coordination database may take before it fails.
DB_CONNECT_TIMEOUT: Final = 5
#: ``safe_time_store_timeout``: the longest one call to a SQL store may take, seconds (see
#: :func:`celery_safe_time.delays.backends.sql.deadline_args`). Well above any statement of the package
#: (each is one short transaction), well below the outages a worker must notice.
DEFAULT_STORE_TIMEOUT: Final = 30.0
#: ``safe_time_coordination_io_timeout``: the longest one call to the PostgreSQL coordination
#: database waits for its answer (client side: the poll of a lock statement, TCP ``tcp_user_timeout``
#: and keepalives), after which the connection is closed and the call fails as unreachable.
DEFAULT_COORDINATION_IO_TIMEOUT: Final = 10.0
#: TCP keepalive probes on coordination connections: this many, unanswered, end the connection
#: (idle time and interval between probes derive from the io timeout).
COORDINATION_KEEPALIVE_COUNT: Final = 3
#: celery-redbeat's default ``redbeat_key_prefix`` (``safe-time beat import-redbeat`` reads its keys).
REDBEAT_KEY_PREFIX: Final = "redbeat:"

# === Redis key names (always behind safe_time_key_prefix) =====================
KEY_BEAT_LEASE: Final = "beat:lease"
KEY_BEAT_EPOCH: Final = "beat:epoch"
KEY_BEAT_LEADER_INFO: Final = "beat:leader"
KEY_BEAT_FIRED: Final = "beat:fired:{entry}:{slot}"
KEY_BEAT_STATE: Final = "beat:state"
KEY_BEAT_DUE: Final = "beat:due"
#: Runtime entries (``save_entry``): hash name -> definition JSON (``beat/entries.py`` documents it).
KEY_BEAT_ENTRIES: Final = "beat:entries"
#: Change counter of the runtime entries: INCR on every stored change (the leader polls it each tick).
KEY_BEAT_ENTRIES_VERSION: Final = "beat:entries:version"
#: Change log: zset name -> the version of its last change (a deletion stays as a tombstone).
KEY_BEAT_ENTRIES_CHANGED: Final = "beat:entries:changed"
#: Name index of the runtime entries: zset, every stored name at score 0, so ``beat list`` pages with
#: ZRANGEBYLEX. Kept by the readers from the change log, not by the writers' scripts.
KEY_BEAT_ENTRIES_NAMES: Final = "beat:entries:names"
#: The change log version the name index reflects (the readers bring it up to date first).
KEY_BEAT_ENTRIES_NAMES_VERSION: Final = "beat:entries:names:version"
#: ``beat run-now`` requests: hash name -> requested slot (ms); the leader publishes and clears them.
KEY_BEAT_RUN_NOW: Final = "beat:entries:run-now"
#: "<version> <planning fingerprint>": the change counter the leader's state and due set reflect, so
#: a new leader re-plans only what changed after it (``beat/scheduler.py`` reconcile).
KEY_BEAT_ENTRIES_APPLIED: Final = "beat:entries:applied"
#: Paused runtime entries with an expiry: zset name -> when the leader resumes them (UNIX seconds),
#: written by the leader as it applies pauses, so a new leader knows them without reading every entry.
KEY_BEAT_PAUSE_EXPIRY: Final = "beat:entries:paused-until"
#: Run history of one entry (``beat/history.py``): hash slot ms -> the published record (JSON), and
#: ``<slot ms>:o`` -> its outcome (JSON, written by the worker).
KEY_BEAT_HISTORY: Final = "beat:history:{entry}"
#: The same entry's slots in order (zset slot ms -> slot ms): what is trimmed to the history size.
KEY_BEAT_HISTORY_SLOTS: Final = "beat:history-slots:{entry}"
#: Change audit of one entry: a list of records (JSON), newest first, trimmed to the audit size.
KEY_BEAT_AUDIT: Final = "beat:audit:{entry}"
#: With ``safe_time_beat_shards`` above 1, shard N (from 1; shard 0 keeps the keys above) has its own
#: lease, epoch, leader info, state, due set, applied marker and pause expiries: the keys above with
#: ``beat:`` replaced by this (``beat:shard:3:lease``). Definitions, the change log and fired markers
#: are shared by every shard.
KEY_BEAT_SHARD_NAMESPACE: Final = "beat:shard:{shard}:"
#: The beat processes taking part in sharded firing: zset member -> its last heartbeat (UNIX seconds).
KEY_BEAT_BEATS: Final = "beat:beats"
KEY_LOCK: Final = "lock:{key}"
# On a Redis Cluster (only there) ``SafeTimeConfig.key`` adds hash tags so that the keys one script
# touches share a slot (:func:`celery_safe_time.config.cluster_key_name`).
#: Beat keys start with this namespace (new beat keys must too, to share the beat slot on a cluster).
KEY_BEAT_NAMESPACE: Final = "beat:"
#: The hash tag that replaces ``beat`` in beat key names on a Redis Cluster.
CLUSTER_BEAT_TAG: Final = "{beat}"
#: A key part that is empty or starts with one of these gets ``~`` in front of it inside the braces
#: (``lock:{~}x}``): an empty tag would not pin the slot, and ``~`` itself is escaped to stay unique.
CLUSTER_TAG_ESCAPE: Final = "~"
CLUSTER_TAG_ESCAPED: Final = frozenset({"}", "~"})
KEY_LOCK_FENCE: Final = "lock-fence:{key}"
KEY_IDEMPOTENT: Final = "idem:{key}"
#: A finished delivery of a locked task (its identity), so a late broker redelivery is dropped.
KEY_LOCK_DONE: Final = "lock-done:{key}:{identity}"
#: A unique task's key (``SafeTask`` option ``unique=``): hash of the holder task id, state, stored flag.
KEY_UNIQUE: Final = "unique:{key}"
#: A ``rate_limit`` key's line: its reservations and the places of the calls admitted within the last
#: period (``locks/rates.py``).
KEY_RATE: Final = "rate:{key}"
#: A ``rate_limit`` key's starts: the real start times of the calls admitted within the last period.
KEY_RATE_STARTS: Final = "rate-starts:{key}"
#: ``concurrency_limit`` slot ``n`` of a key is the overlap lock ``slot:<key>#<n>`` (its own fence
#: counter): a namespace no overlap lock's key begins with (``locks/keys.py`` escapes such keys).
SLOT_KEY: Final = "slot:{key}#{slot}"
SLOT_NAMESPACE: Final = "slot:"

#: How long a fired-slot marker is kept (seconds): 7 days.
FIRED_SLOT_TTL: Final = 7 * 86400
#: How often (seconds) a PostgreSQL beat leader deletes fired-slot rows older than FIRED_SLOT_TTL
#: (Redis markers expire by themselves).
BEAT_PRUNE_INTERVAL: Final = 3600.0

# === message headers ==========================================================
HEADER_SLOT: Final = "safe_time_slot"
HEADER_EPOCH: Final = "safe_time_epoch"
#: On a slot published by ``beat backfill`` (in place of ``HEADER_EPOCH``): that backfill's id.
HEADER_BACKFILL: Final = "safe_time_backfill"
HEADER_STORED: Final = "safe_time_stored"
#: The stored row's delivery token: new on every insert and reschedule, the same on every publish of it.
HEADER_DELIVERY: Final = "safe_time_delivery"
#: Run ids of earlier executions of this delivery in this chain of re-queues (a start whose reply was
#: lost is recognised as our own by them).
HEADER_PRIOR_RUNS: Final = "safe_time_prior_runs"
#: A fresh random token on every publish (``before_task_publish``): a broker redelivery of one
#: message keeps it, a retry or re-queue gets a new one. It names one attempt of one message.
HEADER_ATTEMPT: Final = "safe_time_attempt"
#: On a slot of a beat entry with an overlap policy other than ``allow``: ``{"entry": name, "policy":
#: policy, "ttl": seconds}``; the worker holds the entry's run lease while such a message runs.
HEADER_OVERLAP: Final = "safe_time_overlap"
#: On a slot published by beat or a backfill: the entry's name (the worker fills in its run history).
HEADER_ENTRY: Final = "safe_time_entry"

# === beat =====================================================================
#: The scheduler never sleeps longer than this between ticks (a tick is two Redis reads).
BEAT_TICK_CAP: Final = 1.0
#: A standby beat's sleep between ticks: a standby's tick only reads its lease thread's state, and a
#: new leader's first tick follows the lease within this (a whole tick interval added up to 1 s).
BEAT_STANDBY_WAKE: Final = 0.1
#: safe_time_beat_lease must be at least this many tick granularities.
BEAT_MIN_LEASE_TICKS: Final = 3
#: Due entries handled per tick; the next tick follows at once when more are due.
BEAT_DUE_BATCH: Final = 500
#: A tick with at least this many entries due (a burst) keeps the cyclic garbage collector off while it
#: fires them (their objects are freed by their reference counts).
BEAT_BURST_NO_GC: Final = 100
#: How far past "now" a tick's due read looks for the next entry (the head, how long to sleep): beyond
#: it the tick sleeps its whole granularity anyway (at most BEAT_TICK_CAP; twice that leaves a slow
#: tick's own length of margin). On Redis the due read then also gives the head (no fifth command).
BEAT_HEAD_WINDOW: Final = 2.0 * BEAT_TICK_CAP
#: Seconds to wait for the lease thread on shutdown.
BEAT_RENEW_TIMEOUT: Final = 10.0
#: Most slots walked through when catching up one entry after downtime.
BEAT_CATCHUP_SCAN_LIMIT: Final = 100_000
#: Most slots one ``backfill`` call publishes (``--max``): a wider range is refused, naming its count.
BEAT_BACKFILL_MAX: Final = 1000
#: Slots a backfill claims (marks fired) per round trip before publishing them: a backfill stopped
#: half way loses at most this many claimed and unpublished slots.
BEAT_BACKFILL_BATCH: Final = 100
#: How far back (seconds) a backfill reaches: a fired-slot marker lives FIRED_SLOT_TTL from when it was
#: written, so a slot within this of now still has its marker if it fired (two prune intervals to
#: spare: the backfill's own run and PostgreSQL's prune round).
BEAT_BACKFILL_HORIZON: Final = FIRED_SLOT_TTL - 2 * BEAT_PRUNE_INTERVAL
#: Entries shown by ``celery safe-time status``.
BEAT_STATUS_ENTRIES: Final = 50
#: ``status`` checks every runtime entry (``invalid_entries``) up to this many; above, it says how to
#: page through them (``beat list --state invalid``) instead of reading them all.
BEAT_STATUS_CHECK_MAX: Final = 10_000
#: ``beat list``'s page size by default, and the admin overview's.
BEAT_LIST_LIMIT: Final = 1000
#: ``beat list --state``: most runtime definitions one call reads looking for matches; it stops there
#: and names the cursor to go on from (a filter never reads a million entries in one call).
BEAT_LIST_SCAN: Final = 20_000
#: ``beat list --state due-soon``: most due-set members read (the entries due within the window).
BEAT_LIST_DUE_MAX: Final = 100_000
#: ``beat list --state due-soon``: the window in seconds by default.
BEAT_LIST_SOON: Final = 300.0
#: Runs kept per entry in its history (``safe_time_beat_history_size``; 0 keeps none).
DEFAULT_BEAT_HISTORY_SIZE: Final = 50
#: Changes kept per entry in its audit (``safe_time_beat_audit_size``; 0 keeps none).
DEFAULT_BEAT_AUDIT_SIZE: Final = 50
#: How long (seconds) a deleted runtime entry's runs and changes are kept (unless the name is saved
#: again): 7 days, as fired-slot records.
BEAT_DELETED_HISTORY_KEEP: Final = FIRED_SLOT_TTL
#: The outcomes a run's history record may show (``published`` until the worker reports).
RUN_PUBLISHED: Final = "published"
RUN_SUCCEEDED: Final = "succeeded"
RUN_FAILED: Final = "failed"
RUN_RETRIED: Final = "retried"
RUN_REVOKED: Final = "revoked"
#: The slot was claimed (marked fired) but its publish failed: it never reached the broker.
RUN_NOT_PUBLISHED: Final = "not published"
#: The slot was claimed but its entry's overlap policy dropped it (a run was queued or running).
RUN_DROPPED: Final = "dropped"
#: Format version written into every runtime entry definition (``"format": 1``).
BEAT_ENTRY_FORMAT: Final = 1
#: Source of an entry in ``list_entries``: the app's ``beat_schedule`` or ``save_entry``.
ENTRY_SOURCE_CONFIG: Final = "config"
ENTRY_SOURCE_RUNTIME: Final = "runtime"
#: Changed runtime entries applied per tick (the rest follow at the next tick, at once).
BEAT_CHANGES_BATCH: Final = 2000
#: Once runtime entries exist, the leader ticks at least this often (seconds), so that a change is
#: applied within this long; an idle tick is one Redis round trip.
BEAT_CHANGES_POLL: Final = 0.25
#: Pause/resume is a compare-and-set of the entry's definition; a save landing in between makes it
#: read again, at most this many times before it gives up with an error.
BEAT_ENTRY_SWAP_ATTEMPTS: Final = 20
#: A leader that loaded at least this many entries moves them out of the cyclic collector's sight
#: (``gc.freeze``): a full collection walking 100,000 entries would stall one tick for tens of ms.
BEAT_GC_FREEZE_ENTRIES: Final = 10_000
#: From this many runtime entries on (Redis), a leader reads definitions only for the entries that
#: fall due (and those that change), not every entry at takeover: memory and takeover time stop
#: growing with the number of entries. Below it, loading all is cheap and keeps the stricter checks.
BEAT_LAZY_ENTRIES: Final = 10_000
#: Sharded firing: a beat whose heartbeat is older than this share of the lease counts as gone (less
#: than one lease, so that its shards, free after one lease, are taken at the next standby poll).
BEAT_SHARD_HEARTBEAT_LEASES: Final = 2 / 3
#: Runtime entries a reading-what-is-due leader keeps built between ticks (then it forgets them all).
BEAT_LAZY_CACHE: Final = 10_000
#: Entries ``save_entries`` validates and then stores in one round trip (a bad entry stores none of its chunk).
BEAT_SAVE_CHUNK: Final = 1000
#: Definitions read (HSCAN) and planned per round when such a leader re-plans every entry.
BEAT_LAZY_CHUNK: Final = 5_000
#: The next-occurrence search of an rrule schedule covers this many years after the time asked about
#: (or after the rule's start, when later), up to one Gregorian cycle more, then answers "never fires
#: again". The calendar repeats every 400 years (leap years, weekdays: 146097 days are 20871 weeks), so
#: a rule with no occurrence in 400 years has none later, unless its INTERVAL spans centuries
#: (``FREQ=YEARLY;INTERVAL=1000``: an occurrence past the horizon counts as none). dateutil alone walks
#: every period to the year 9999 before it says "none": 2.9 s of CPU for
#: ``FREQ=DAILY;BYMONTH=2;BYMONTHDAY=30``, 0.3 s within this bound. ``BYEASTER`` rules (Easter does not
#: repeat with the calendar) are searched as dateutil does.
RRULE_SEARCH_YEARS: Final = 400
#: The Gregorian cycle: an rrule moved by a whole number of them has the same occurrences, moved.
GREGORIAN_CYCLE_YEARS: Final = 400


# === delays ===================================================================
SWEEP_TASK_NAME: Final = "celery_safe_time.sweep"
SWEEP_ENTRY_NAME: Final = "celery_safe_time.sweep"

#: Extra seconds a sweep looks ahead; rows due within it are published with eta=due_at.
SWEEP_LOOKAHEAD: Final = 2.0
#: The adaptive look-ahead (a backlog due soon is claimed early enough to be out by its due time) never
#: exceeds this many seconds, nor a tenth of the broker's visibility / consumer timeout.
SWEEP_LOOKAHEAD_MAX: Final = 300.0
#: ``insert_many``: idempotency keys looked up per query, rows per multi-row INSERT.
BULK_KEY_LOOKUP: Final = 1000
BULK_INSERT_CHUNK: Final = 2000
#: Default ``safe_time_sweep_max_ahead``: the look-ahead never reaches past this many pending rows.
DEFAULT_SWEEP_MAX_AHEAD: Final = 100_000

#: Row states of a stored delayed task.
STATUS_PENDING: Final = "pending"
STATUS_CLAIMED: Final = "claimed"
STATUS_SENT: Final = "sent"
STATUS_CANCELLED: Final = "cancelled"
STATUS_EXPIRED: Final = "expired"
STATUS_FAILED: Final = "failed"
#: A worker started the delivery (the conditional start won); ``heartbeat_at`` says it is alive.
STATUS_STARTED: Final = "started"
#: The delivery ran to an end; ``outcome`` says which.
STATUS_FINISHED: Final = "finished"
DELAY_STATUSES: Final = (
    STATUS_PENDING,
    STATUS_CLAIMED,
    STATUS_SENT,
    STATUS_STARTED,
    STATUS_FINISHED,
    STATUS_CANCELLED,
    STATUS_EXPIRED,
    STATUS_FAILED,
)
#: Finished states (purge may delete them, a new insert with the same task id replaces them).
DELAY_FINISHED_STATUSES: Final = frozenset(
    {STATUS_SENT, STATUS_FINISHED, STATUS_CANCELLED, STATUS_EXPIRED, STATUS_FAILED}
)
#: States a new delay with an already used task id replaces: the finished ones, and ``started``
#: (``retry(countdown=...)`` from the running task stores its next attempt under the same id).
DELAY_REPLACEABLE_STATUSES: Final = DELAY_FINISHED_STATUSES | {STATUS_STARTED}
#: States a delivery may start from, given its token: ``pending`` (reclaimed or re-published after its
#: message went out), ``claimed`` (the sweep has not marked it sent yet), ``sent``.
DELAY_STARTABLE_STATUSES: Final = frozenset({STATUS_PENDING, STATUS_CLAIMED, STATUS_SENT})
#: States ``cancel`` stops: not started yet, whether or not a message is already out.
DELAY_CANCELLABLE_STATUSES: Final = DELAY_STARTABLE_STATUSES
#: States ``rerun`` sends back to pending: the rows that ended without their task running.
DELAY_RERUNNABLE_STATUSES: Final = frozenset({STATUS_FAILED, STATUS_EXPIRED})

#: ``outcome`` of a finished delivery.
OUTCOME_SUCCEEDED: Final = "succeeded"
OUTCOME_FAILED: Final = "failed"
OUTCOME_RETRIED: Final = "retried"
OUTCOME_IGNORED: Final = "ignored"
#: The worker died mid-run (no heartbeat) and the task is not acks_late: it is not run again.
OUTCOME_INTERRUPTED: Final = "interrupted"
DELAY_OUTCOMES: Final = (OUTCOME_SUCCEEDED, OUTCOME_FAILED, OUTCOME_RETRIED, OUTCOME_IGNORED, OUTCOME_INTERRUPTED)

#: Finished states ``purge`` deletes unless told otherwise. ``failed`` is left out: those rows wait
#: for an operator, so neither the retention purge nor a bare ``delays purge`` drops them.
PURGE_DEFAULT_STATUSES: Final = frozenset({STATUS_SENT, STATUS_FINISHED, STATUS_CANCELLED, STATUS_EXPIRED})
#: States ``purge`` accepts: never a pending or claimed row, which is still work to do.
PURGEABLE_STATUSES: Final = DELAY_FINISHED_STATUSES
#: Rows deleted per purge transaction (short transactions, short row locks).
PURGE_BATCH: Final = 1000

#: Table shared by the SQLAlchemy store and the Django model (one schema, either client).
DELAY_TABLE: Final = "celery_safe_time_delay"
#: Index names stay within Django's 30-character limit.
DELAY_DUE_INDEX: Final = "cst_delay_due_pending"
DELAY_KEY_INDEX: Final = "cst_delay_key_pending"
DELAY_CLAIMED_INDEX: Final = "cst_delay_claimed"
DELAY_SENT_INDEX: Final = "cst_delay_sent"
DELAY_STARTED_INDEX: Final = "cst_delay_started"
#: The purge's index: ``updated_at`` of finished rows (MySQL/MariaDB: ``(status, updated_at)``).
DELAY_UPDATED_INDEX: Final = "cst_delay_updated"

#: SQLAlchemy dialect names of MySQL and MariaDB (a ``mysql://`` URL on MariaDB is still "mysql").
MYSQL_DIALECTS: Final = frozenset({"mysql", "mariadb"})
#: MySQL/MariaDB only: a generated column equal to ``idempotency_key`` while the row is pending and
#: NULL otherwise. Its UNIQUE index stands in for the partial unique index they lack.
DELAY_PENDING_KEY_COLUMN: Final = "pending_idempotency_key"
#: PostgreSQL advisory locks (``pg_advisory_xact_lock``, one key per capability) that serialise
#: creating or upgrading that capability's tables between processes starting together.
DELAY_SCHEMA_LOCK_KEY: Final = 0x5AFE7133
BEAT_SCHEMA_LOCK_KEY: Final = 0x5AFE7135
LOCK_SCHEMA_LOCK_KEY: Final = 0x5AFE7140C4

#: Column sizes (Django model and SQLAlchemy table agree on them).
DELAY_ID_LENGTH: Final = 255
DELAY_TASK_LENGTH: Final = 255
DELAY_KEY_LENGTH: Final = 255
DELAY_CONTENT_TYPE_LENGTH: Final = 128
DELAY_ENCODING_LENGTH: Final = 64
DELAY_ERROR_LENGTH: Final = 4000
DELAY_NAMESPACE_LENGTH: Final = 64

#: apply_async option that deduplicates pending delays.
OPTION_IDEMPOTENCY_KEY: Final = "idempotency_key"
#: apply_async options of a debounced call: the quiet period, its key template, the cap from the first call.
OPTION_DEBOUNCE: Final = "debounce"
OPTION_DEBOUNCE_KEY: Final = "debounce_key"
OPTION_DEBOUNCE_MAX_WAIT: Final = "debounce_max_wait"
#: What a stored row holds in its idempotency key (the pending-only unique key of the store), one prefix
#: per kind so that no kind can match another's: a debounced row ``debounce:<task name>:<key>``, a
#: caller's ``idempotency_key=`` ``caller:<task name>:<key>``, a stored unique task ``unique:<key>``
#: (unique keys are global, as on the lock backend). The task name is escaped like a key value
#: (``%``, ``:``, ``#``), so the task's part ends at the first ``:`` and two tasks never share a key.
DEBOUNCE_KEY_PREFIX: Final = "debounce:"
CALLER_KEY_PREFIX: Final = "caller:"
UNIQUE_ROW_KEY_PREFIX: Final = "unique:"
#: Task options (``@app.task(base=SafeTask, ...)``) of per-key flow control: the rate (``"100/m"``) and
#: its key template, the concurrency limit and its key template. A limit without a key is one key for
#: the whole task: its name.
OPTION_RATE_LIMIT: Final = "safe_time_rate_limit"
OPTION_RATE_KEY: Final = "safe_time_rate_key"
OPTION_CONCURRENCY_LIMIT: Final = "safe_time_concurrency_limit"
OPTION_CONCURRENCY_KEY: Final = "safe_time_concurrency_key"
#: A debounced call that meets a concurrent one (both found no pending row and both inserted, or a
#: deadlock) runs its transaction again, at most this many times.
DEBOUNCE_ATTEMPTS: Final = 5

#: A delivery that finds itself running elsewhere (a redelivered copy) comes back after this share of
#: the heartbeat timeout (``safe_time_lock_ttl``), until the run ends or its heartbeat stops.
DELIVERY_RUNNING_RECHECK: Final = 1.0 / 3.0
DELIVERY_TOKEN_LENGTH: Final = 64
DELIVERY_WORKER_LENGTH: Final = 255


# === locks and idempotency ====================================================
#: Seconds a conflicting run waits before it is re-queued (``on_conflict="retry"``).
DEFAULT_LOCK_RETRY_AFTER: Final = 10.0
#: Default jitter, as a fraction of ``retry_after``, added on top of it so re-queued runs spread out.
DEFAULT_LOCK_RETRY_JITTER: Final = 0.5
#: ``idempotent`` remembers a successful key this long unless ``window=`` says otherwise.
DEFAULT_IDEMPOTENT_WINDOW: Final = 86400.0
ON_CONFLICT_POLICIES: Final = frozenset({"retry", "skip", "raise"})
ON_BACKEND_ERROR_POLICIES: Final = frozenset({"retry", "raise"})
#: The same policies as types, so mypy and editors reject ``on_conflict="explode"`` before it runs.
OnConflict = Literal["retry", "skip", "raise"]
OnBackendError = Literal["retry", "raise"]
#: The in-progress lock of an idempotent key is the overlap lock ``idem:<key>``.
IDEMPOTENT_LOCK_NAMESPACE: Final = "idem:"
#: A lock never outlives its task's hard time limit by more than this (the pool kills the child).
LOCK_HARD_LIMIT_MARGIN: Final = 1.0
#: A lease (lock, concurrency slot, beat's leader lease) runs from when its acquire was sent: the server
#: dates it from when the request arrived, which the holder cannot see. An acquire answered more than
#: this share of the lease after it was sent counts as failed and is released: the holder's first
#: renewal (a third of the lease in) must still land before the lease, dated from the send, ends.
LEASE_LATE_REPLY_SHARE: Final = 1 / 3
#: Message header counting how often a run was re-queued by a lock conflict or a lock backend outage;
#: these re-queues do not consume the task's ``max_retries``.
HEADER_LOCK_REQUEUES: Final = "safe_time_requeues"
#: When the lock backend (Redis or PostgreSQL) first failed for this delivery (epoch seconds), carried
#: by its outage re-queues. The header keeps its name: messages already queued carry it.
HEADER_LOCK_REDIS_DOWN: Final = "safe_time_redis_down_since"
#: A locked task that finds its lock backend unreachable waits ``retry_after`` (at least ``..._MIN``) at first,
#: then this share of how long the outage has lasted so far (waits grow about 1.5x per re-queue), at
#: most ``..._CAP`` seconds: a blip (a lost reply) costs nothing more, and a long outage does not spin
#: every locked message through the broker every few seconds.
LOCK_REDIS_DOWN_BACKOFF_MIN: Final = 0.5
LOCK_REDIS_DOWN_BACKOFF_SHARE: Final = 0.5
LOCK_REDIS_DOWN_BACKOFF_CAP: Final = 60.0
#: ``Task.request`` attributes set while a lock is held.
REQUEST_FENCE_ATTR: Final = "safe_time_fence"
REQUEST_LOCK_ATTR: Final = "safe_time_lock"
#: ``Task.request`` attribute naming how a gate ended this delivery without running its body
#: (``ADMISSION_WAITING`` or ``ADMISSION_DUPLICATE``); absent while the body may run. Every gate a
#: delivery passes reads it on the way out: a hold around a body that never ran is released as not run.
REQUEST_ADMISSION_ATTR: Final = "safe_time_admission"
#: ``Task.request`` attribute holding an ``AdmissionWatch``: what a caller outside the gates learns of
#: the delivery (``unique_until="executing"`` frees its key once every gate admitted it, not before).
REQUEST_ADMISSION_WATCH_ATTR: Final = "safe_time_admission_watch"
#: A gate re-queued the delivery (it comes back as the same delivery): no gate records it as finished.
ADMISSION_WAITING: Final = "waiting"
#: A gate dropped the delivery as a copy of one that runs or ran (the run history says ``dropped``).
ADMISSION_DUPLICATE: Final = "duplicate"
#: A gate ended the delivery without its body by its own rule (``on_conflict="skip"``, an ``idempotent``
#: key already recorded): the delivery is over, but no outer gate records the work as done.
ADMISSION_SKIPPED: Final = "skipped"
#: The flow-control view (``status``, the admin) looks at most at this many rate-limit keys.
RATE_SCAN_KEYS: Final = 200
#: A delay store without a count query of its own reads at most this many pending rows to count the
#: debounced ones.
DEBOUNCE_COUNT_LIMIT: Final = 10_000
#: Message header carrying a unique task's rendered key, so the worker frees the key it was queued under.
HEADER_UNIQUE: Final = "safe_time_unique"
#: Message header our own re-queues carry: the identity of the delivery they continue (so a copy
#: is still recognised as that delivery when it comes back), the retry count it belongs to (a
#: ``retry()`` copies custom headers but is a new delivery) and the lock tokens earlier attempts
#: sent whose reply was lost (so the copy recognises an orphaned lock as its own).
HEADER_LOCK_ORIGIN: Final = "safe_time_lock_origin"
#: When a ``rate_limit``ed delivery first found its limit full (epoch seconds), carried by its re-queues:
#: the call's lateness is measured from it when the limit admits it.
HEADER_RATE_SINCE: Final = "safe_time_rate_since"
#: The reservation token a ``rate_limit``ed call was re-queued with (a place of its own in the key's log).
HEADER_RATE_TOKEN: Final = "safe_time_rate_token"
#: The ``rate_limit`` key (rendered) that reservation is on: a gate that drops the call frees its place.
HEADER_RATE_KEY: Final = "safe_time_rate_key"
#: A reservation is re-queued to come back this many seconds before it is due and waits out the rest in
#: the worker: the broker's delivery delay (tens of ms) would otherwise be added to every place's cycle
#: (a limit of 20/s would give about 18/s), as the log records a call at its real start.
RATE_LEAD: Final = 0.15


# === unique tasks (``SafeTask`` options ``unique=``, ``unique_until=``, ``unique_ttl=``) ==========
#: ``unique_until``: released when the task starts, when it ends (whatever the outcome), or only by its ttl.
UNIQUE_UNTIL_EXECUTING: Final = "executing"
UNIQUE_UNTIL_EXECUTED: Final = "executed"
UNIQUE_UNTIL_EXPIRED: Final = "expired"
UNIQUE_UNTIL_MODES: Final = (UNIQUE_UNTIL_EXECUTING, UNIQUE_UNTIL_EXECUTED, UNIQUE_UNTIL_EXPIRED)
DEFAULT_UNIQUE_UNTIL: Final = UNIQUE_UNTIL_EXECUTED
#: Seconds a unique key outlives a holder that never released it (kill -9, a message the broker lost);
#: counted from the call, again from the start of the run, and from the due time of a stored delay.
DEFAULT_UNIQUE_TTL: Final = 3600.0
#: ``unique_on_conflict``: hand back the holder's AsyncResult, or raise ``UniqueConflict``.
UNIQUE_ON_CONFLICT_POLICIES: Final = ("return", "raise")
DEFAULT_UNIQUE_ON_CONFLICT: Final = "return"
#: ``state`` of a unique key: queued on the broker, stored as a long delay, running, waiting for its retry.
UNIQUE_STATE_QUEUED: Final = "queued"
UNIQUE_STATE_STORED: Final = "stored"
UNIQUE_STATE_RUNNING: Final = "running"
UNIQUE_STATE_RETRYING: Final = "retrying"
#: ``locks list`` shows unique keys as ``unique:<key>``; ``locks release unique:<key>`` frees one.
UNIQUE_LIST_PREFIX: Final = "unique:"

# === beat overlap policies ====================================================
#: What a beat entry does with a slot while a run of it is queued or running (``safe_time_overlap``).
OVERLAP_POLICIES: Final = ("allow", "skip", "buffer_one", "buffer_all", "cancel_other")
#: The run lease of a beat entry (an overlap lock) and its queued-run marker (a unique key).
OVERLAP_ENTRY_KEY: Final = "beat-entry:{entry}"
#: The queued marker of one ``buffer_all`` run (each waits in slot order behind the one before it).
OVERLAP_RUN_KEY: Final = "beat-entry:{entry}:run:{task_id}"
#: A unique key naming the last ``buffer_all`` run beat published for an entry.
OVERLAP_LAST_KEY: Final = "beat-entry:{entry}:last"
#: How long that name is kept (seconds): the next run only needs it while the last one may wait.
OVERLAP_LAST_TTL: Final = 7 * 86400
#: The signal ``cancel_other`` terminates the running run with (``app.control.revoke(terminate=True)``).
OVERLAP_CANCEL_SIGNAL: Final = "SIGTERM"
