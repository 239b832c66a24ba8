-- The SQL store's raw statements, each under a "-- name: <name>" header (read by
-- celery_safe_time.delays.backends.sql.query). The claim, the writes and the reads are built with
-- SQLAlchemy Core (statements.py, store.py) so that one definition serves every dialect; what is
-- here is what has no Core construct or differs per database.

-- name: now_postgresql
-- The database's current time when the statement runs (not at transaction start).
SELECT clock_timestamp()

-- name: now_sqlite
SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')

-- name: now_mysql
-- UTC with microseconds whatever the session's time_zone (NOW(6) would follow it); DATETIME columns
-- store what they get, unconverted. MariaDB alike.
SELECT UTC_TIMESTAMP(6)

-- name: lock_schema_postgresql
-- Several processes start at once: their DDL waits for this transaction's lock instead of racing.
SELECT pg_advisory_xact_lock(:key)

-- name: lock_schema_mysql
-- MySQL DDL commits at once, so a session lock (not a transaction's) serializes table creation.
SELECT GET_LOCK(:name, :timeout)

-- name: unlock_schema_mysql
SELECT RELEASE_LOCK(:name)
