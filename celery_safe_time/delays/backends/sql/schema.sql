-- Fragments of the SQL store's table definition (schema.py builds the table with SQLAlchemy Core,
-- which renders the DDL of each dialect), each under a "-- name: <name>" header.

-- name: pending_rows
-- Partial index predicates (PostgreSQL, SQLite): the claim only ever reads pending rows in due order,
-- so its index stays as small as the backlog however many sent rows the table keeps.
status = 'pending'

-- name: claimed_rows
status = 'claimed'

-- name: sent_rows
-- The delivery confirmation scans: rows sent but never started, rows started whose heartbeat stopped.
status = 'sent'

-- name: started_rows
status = 'started'

-- name: pending_key_mysql
-- MySQL/MariaDB have no partial indexes: the pending-only unique key is a UNIQUE index on this
-- generated column, NULL unless the row is pending (NULLs never collide).
CASE WHEN status = 'pending' THEN idempotency_key END
