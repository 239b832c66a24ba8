-- The PostgreSQL lock backend's statements (PostgresLockBackend, PostgresSessionLockBackend), by name.
-- A line starting with "-- name:" begins a statement; other lines starting with "--" at column 0 are
-- comments of this file.
--
-- The SQL names its tables literally: no statement of the backend is built from strings. Two
-- parameter styles: the per-task calls (acquire, renew, release, commit and their session forms) take
-- $1, $2 ... with a cast each, as _Call in postgres.py sends them through libpq untyped (or through the
-- driver's cursor as %s); every other statement takes :name parameters (SQLAlchemy text()).
--
-- A row counts only while expires_at > now(): the database's clock decides expiry, never a worker's.

-- Schema: whether this database has the current functions (ensure_schema creates them when not),
-- and the transaction lock that serialises their creation between processes.
-- It reads pg_proc itself: to_regproc answers from a cache that keeps an earlier "absent" for the
-- rest of the transaction, and ensure_schema asks again under the lock, where it must see a schema
-- another process made while this one waited.
-- name: schema_present
SELECT count(DISTINCT p.proname) = 2
  FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
 WHERE p.proname IN ('safe_time_lock_take', 'safe_time_rate_admit') AND n.nspname = ANY (current_schemas(false))

-- name: schema_lock
SELECT pg_advisory_xact_lock(:key)

-- health: whether the lock tables exist (a function made with them), without creating anything.
-- name: tables_present
SELECT to_regproc('safe_time_unique_claim') IS NOT NULL

-- name: held_count
SELECT count(*) FROM safe_time_lock WHERE expires_at > now()

-- Lease mode: one statement per call. Returns (status, fence, own, holder task id, host, pid).
-- name: acquire
SELECT * FROM safe_time_lock_take($1::text, $2::text, $3::text, $4::text, $5::bigint, $6::text,
    $7::text, $8::integer, $9::text, $10::text[], $11::boolean)

-- name: renew
UPDATE safe_time_lock SET renewed_at = now(), expires_at = now() + $1::bigint * interval '1 millisecond'
WHERE name = $2::text AND token = $3::text AND expires_at > now()

-- A release skips its WAL flush (see safe_time_lock_give_back in schema.sql).
-- name: release
SELECT safe_time_lock_give_back($1::text, $2::text, $3::text, $4::text, $5::bigint, false)

-- Returns (recorded, released).
-- name: commit
SELECT * FROM safe_time_lock_commit_marker($1::text, $2::text, $3::text, $4::bigint, $5::text, $6::text,
    $7::bigint, false)

-- Session mode: the advisory lock is the session's, so renewing checks that the session is alive and
-- the row still ours, and a release or commit also gives the session's advisory locks back.
-- name: session_renew
SELECT 1 FROM safe_time_lock WHERE name = $1::text AND token = $2::text

-- name: session_release
SELECT safe_time_lock_give_back($1::text, $2::text, $3::text, $4::text, $5::bigint, true),
    pg_advisory_unlock_all()

-- name: session_commit
SELECT recorded, released, pg_advisory_unlock_all()
FROM safe_time_lock_commit_marker($1::text, $2::text, $3::text, $4::bigint, $5::text, $6::text, $7::bigint, true)

-- The rows of :names whose advisory lock some session holds (pg_locks shows a bigint key as classid,
-- objid); a row without one was left by a holder that died.
-- name: advisory_held
SELECT name FROM unnest(CAST(:names AS text[])) AS name WHERE EXISTS (SELECT 1 FROM pg_locks
    WHERE locktype = 'advisory' AND granted AND objsubid = 1 AND database = (SELECT oid FROM pg_database
    WHERE datname = current_database())
    AND classid = ((hashtextextended(name, 0) >> 32) & 4294967295)::oid
    AND objid = (hashtextextended(name, 0) & 4294967295)::oid)

-- The hard-time-limit release's view of a holder: (token, task id, host, pid).
-- name: holder
SELECT token, task_id, host, pid FROM safe_time_lock WHERE name = :name AND expires_at > now()

-- A held lock as the operator view reads it: name, task_id, host, pid, fence, age, ttl left (NULL for
-- a session lock, which has no expiry).
-- name: info
SELECT name, task_id, host, pid, fence, extract(epoch FROM now() - acquired_at)::float8,
    CASE WHEN expires_at = 'infinity' THEN NULL ELSE extract(epoch FROM expires_at - now())::float8 END
FROM safe_time_lock WHERE name = :name AND expires_at > now()

-- :like is a prefix (LIKE with ! as escape); the caller filters by the glob exactly.
-- name: scan
SELECT name, task_id, host, pid, fence, extract(epoch FROM now() - acquired_at)::float8,
    CASE WHEN expires_at = 'infinity' THEN NULL ELSE extract(epoch FROM expires_at - now())::float8 END
FROM safe_time_lock WHERE name LIKE :like ESCAPE '!' AND expires_at > now()

-- The info columns, then whether the deleted row was still live.
-- name: force_release
DELETE FROM safe_time_lock WHERE name = :name RETURNING name, task_id, host, pid, fence,
    extract(epoch FROM now() - acquired_at)::float8,
    CASE WHEN expires_at = 'infinity' THEN NULL ELSE extract(epoch FROM expires_at - now())::float8 END,
    expires_at > now()

-- name: marker_live
SELECT 1 FROM safe_time_lock_marker WHERE name = :name AND expires_at > now()

-- Unique task keys. Returns (status, holder task id, state, stored, ms left).
-- name: unique_acquire
SELECT * FROM safe_time_unique_claim(:name, :task_id, :ttl_ms, :state, :stored, :host, :gone, :own)

-- name: unique_release
DELETE FROM safe_time_unique WHERE name = :name AND task_id = :task_id AND expires_at > now()

-- A unique key as the operator view reads it: name, task_id, host, state, age, ttl left.
-- name: unique_info
SELECT name, task_id, host, state, extract(epoch FROM now() - created_at)::float8,
    extract(epoch FROM expires_at - now())::float8 FROM safe_time_unique WHERE name = :name AND expires_at > now()

-- name: unique_scan
SELECT name, task_id, host, state, extract(epoch FROM now() - created_at)::float8,
    extract(epoch FROM expires_at - now())::float8 FROM safe_time_unique
WHERE name LIKE :like ESCAPE '!' AND expires_at > now()

-- The unique_info columns, then whether the deleted row was still live.
-- name: unique_force_release
DELETE FROM safe_time_unique WHERE name = :name RETURNING name, task_id, host, state,
    extract(epoch FROM now() - created_at)::float8, extract(epoch FROM expires_at - now())::float8,
    expires_at > now()

-- Expired rows, at most 1,000 per table per purge, so a purge (run after a release) stays short.
-- name: purge_markers
DELETE FROM safe_time_lock_marker WHERE ctid = ANY(ARRAY(SELECT ctid FROM safe_time_lock_marker
    WHERE expires_at < now() LIMIT 1000))

-- name: purge_unique
DELETE FROM safe_time_unique WHERE ctid = ANY(ARRAY(SELECT ctid FROM safe_time_unique
    WHERE expires_at < now() LIMIT 1000))

-- name: purge_rates
DELETE FROM safe_time_rate WHERE ctid = ANY(ARRAY(SELECT ctid FROM safe_time_rate
    WHERE expires_at < now() LIMIT 1000))

-- Returns (admitted, entries, wait in microseconds, the database clock in epoch seconds).
-- name: rate_take
SELECT * FROM safe_time_rate_admit(:name, :token, :limit, :period_us, :reserve)

-- The operator view of rate limits: per key, calls started within their period (an admitted row
-- expires a period after its start) and reservations still ahead; at most :keys keys.
-- name: rate_counts
SELECT name,
    count(*) FILTER (WHERE started IS NOT NULL AND started <= now() AND expires_at > now()),
    count(*) FILTER (WHERE at > now())
FROM safe_time_rate WHERE name LIKE :like ESCAPE '!' AND expires_at > now()
GROUP BY name ORDER BY name LIMIT :keys

-- A reservation given up (its call was dropped): the bare token's row, never an admitted call's.
-- name: rate_release
DELETE FROM safe_time_rate WHERE name = :name AND member = :token AND started IS NULL

-- name: purge_locks
DELETE FROM safe_time_lock WHERE ctid = ANY(ARRAY(SELECT ctid FROM safe_time_lock
    WHERE expires_at < now() LIMIT 1000))
