-- The PostgreSQL lock backend's schema: tables, the fence sequence and the PL/pgSQL functions that
-- hold the Lua scripts' rules (locks/lua/*.lua), run in this order by postgres_sql.ensure_schema in one
-- transaction under a transaction-level advisory lock. Every statement is idempotent (IF NOT EXISTS,
-- CREATE OR REPLACE, or a DO block that looks first), so processes starting together need nothing
-- else. A change of a function's rules takes a name never used before (CREATE OR REPLACE cannot change
-- a return type), so workers of two releases side by side each call the rules they know.
--
-- A line starting with "-- name:" begins a statement; other lines starting with "--" at column 0 are
-- comments of this file (comments inside a function body are indented and sent with it).

-- One row per held lock: the Redis key name <prefix>lock:<key>, the holder and its lease.
-- name: lock
CREATE TABLE IF NOT EXISTS safe_time_lock (
    name text PRIMARY KEY,
    token text NOT NULL,
    task_id text,
    identity text,
    host text,
    pid integer,
    fence bigint NOT NULL,
    acquired_at timestamptz NOT NULL,
    renewed_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL
)

-- name: lock_expires
CREATE INDEX IF NOT EXISTS safe_time_lock_expires ON safe_time_lock (expires_at)

-- Idempotency markers (<prefix>idem:<key>) and finished-delivery markers (<prefix>lock-done:...).
-- name: marker
CREATE TABLE IF NOT EXISTS safe_time_lock_marker (
    name text PRIMARY KEY,
    task_id text,
    token text,
    created_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL
)

-- name: marker_expires
CREATE INDEX IF NOT EXISTS safe_time_lock_marker_expires ON safe_time_lock_marker (expires_at)

-- Unique task keys (<prefix>unique:<key>).
-- name: unique
CREATE TABLE IF NOT EXISTS safe_time_unique (
    name text PRIMARY KEY,
    task_id text NOT NULL,
    state text,
    stored boolean NOT NULL DEFAULT false,
    host text,
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL
)

-- name: unique_expires
CREATE INDEX IF NOT EXISTS safe_time_unique_expires ON safe_time_unique (expires_at)

-- The server start time fences were last made safe for (see safe_time_lock_fence_resync).
-- name: boot
CREATE TABLE IF NOT EXISTS safe_time_lock_boot (
    id integer PRIMARY KEY,
    started_at timestamptz NOT NULL
)

-- The fencing numbers of every key. A sequence never goes back; it starts at the creation time in
-- microseconds, above the fences a Redis backend handed out before a switch. Looked up first, as
-- CREATE SEQUENCE IF NOT EXISTS cannot take a START computed at run time.
-- name: fence
DO $$ BEGIN
    IF to_regclass('safe_time_lock_fence') IS NULL THEN
        EXECUTE 'CREATE SEQUENCE safe_time_lock_fence AS bigint START WITH '
            || ((extract(epoch FROM clock_timestamp()) * 1000000)::bigint)::text;
    END IF;
END $$

-- The commit rules of commit.lua: the idempotency marker, the finished-delivery marker and the
-- release, in one transaction.
-- name: commit_marker
CREATE OR REPLACE FUNCTION safe_time_lock_commit_marker(
    p_lock text, p_marker text, p_token text, p_window_ms bigint, p_task_id text, p_done text,
    p_done_ms bigint, p_session boolean)
RETURNS TABLE (recorded boolean, released boolean)
LANGUAGE plpgsql AS $$
DECLARE
    is_recorded boolean;
    is_released boolean;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_lock, 1));
    -- The marker is written even when the lock was lost meanwhile: the body did succeed, and the
    -- first live marker is kept. One holding our own token counts as recorded (a retried commit).
    INSERT INTO safe_time_lock_marker (name, task_id, token, created_at, expires_at)
    VALUES (p_marker, p_task_id, p_token, now(), now() + p_window_ms * interval '1 millisecond')
    ON CONFLICT (name) DO UPDATE SET task_id = EXCLUDED.task_id, token = EXCLUDED.token,
        created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at
    WHERE safe_time_lock_marker.expires_at <= now();
    is_recorded := FOUND;
    IF NOT is_recorded THEN
        SELECT m.token = p_token INTO is_recorded FROM safe_time_lock_marker m WHERE m.name = p_marker;
    END IF;
    IF p_done IS NOT NULL THEN
        INSERT INTO safe_time_lock_marker (name, task_id, created_at, expires_at)
        VALUES (p_done, p_task_id, now(), now() + p_done_ms * interval '1 millisecond')
        ON CONFLICT (name) DO UPDATE SET task_id = EXCLUDED.task_id, created_at = EXCLUDED.created_at,
            expires_at = EXCLUDED.expires_at;
    END IF;
    DELETE FROM safe_time_lock WHERE name = p_lock AND token = p_token AND (p_session OR expires_at > now());
    is_released := FOUND;
    RETURN QUERY SELECT coalesce(is_recorded, false), is_released;
END $$

-- A release commits without waiting for its WAL flush (synchronous_commit off for this one
-- transaction): a crash can forget at most the last fraction of a second of releases, and a
-- forgotten release only keeps the lock until its lease runs out.
-- name: give_back
CREATE OR REPLACE FUNCTION safe_time_lock_give_back(
    p_name text, p_token text, p_done text, p_task_id text, p_done_ms bigint, p_session boolean)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_name, 1));
    PERFORM set_config('synchronous_commit', 'off', true);
    IF p_done IS NOT NULL THEN
        INSERT INTO safe_time_lock_marker (name, task_id, created_at, expires_at)
        VALUES (p_done, p_task_id, now(), now() + p_done_ms * interval '1 millisecond')
        ON CONFLICT (name) DO UPDATE SET task_id = EXCLUDED.task_id, created_at = EXCLUDED.created_at,
            expires_at = EXCLUDED.expires_at;
    END IF;
    DELETE FROM safe_time_lock WHERE name = p_name AND token = p_token AND (p_session OR expires_at > now());
    RETURN FOUND;
END $$

-- Fences after a crash. An acquire commits without waiting for its WAL flush (below), so a crash can
-- forget the last acquires, and with them the sequence's WAL record that covered their fences: after
-- recovery the sequence could hand the same fences out again. The first acquire of every session
-- (every session after a restart is new) runs this: once per server start, under a transaction
-- lock, the sequence jumps to at least the database clock in microseconds (fences lag it: they grow
-- by one per acquire from the clock at creation), above every fence handed out before the restart.
-- That transaction commits synchronously.
-- name: fence_resync
CREATE OR REPLACE FUNCTION safe_time_lock_fence_resync() RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    seen timestamptz;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('safe_time_lock_fence_guard', 1));
    SELECT b.started_at INTO seen FROM safe_time_lock_boot b WHERE b.id = 1;
    IF seen IS DISTINCT FROM pg_postmaster_start_time() THEN
        PERFORM setval('safe_time_lock_fence', greatest(
            (SELECT s.last_value FROM safe_time_lock_fence s),
            (extract(epoch FROM clock_timestamp()) * 1000000)::bigint));
        INSERT INTO safe_time_lock_boot (id, started_at) VALUES (1, pg_postmaster_start_time())
        ON CONFLICT (id) DO UPDATE SET started_at = EXCLUDED.started_at;
    END IF;
END $$

-- The acquire rules of acquire.lua, after the fence guard on a session's first call. Returns one row of
-- OUT values (status, fence, own, holder task id, host, pid). p_session: the lock itself is a session
-- advisory lock on this connection (taken here); the row only describes its holder, and a row whose
-- advisory lock nobody holds is stale.
--
-- One acquire, commit or release of a key runs at a time (a transaction advisory lock, held to the
-- commit): the marker checks then see a commit or release that ended just before, as the Redis script,
-- which runs alone, does. Without it a run could check the markers, wait on the row the finishing holder
-- deletes, find it gone and run a key (or a delivery) a second time. Both markers are read in one index
-- probe, and the row is inserted first (the usual case: the key is free). A conflicting INSERT takes a
-- fence it then drops: fences come only from the sequence and only grow, with gaps (as across keys).
--
-- A lease acquire commits as the server's synchronous_commit says (on by default: it waits for its WAL
-- flush, so neither a restart nor a crash forgets it). A session-mode acquire does not wait
-- (synchronous_commit off for this one transaction): any restart ends the sessions and frees their
-- advisory locks anyway. Where an operator turns synchronous_commit off for the role or in the URL, a
-- crash can forget the acquires of its last moments (at most 3 x wal_writer_delay): their holders
-- learn it at their next renewal (LockLost), and their fences stay below every later one (the guard).
-- name: take
CREATE OR REPLACE FUNCTION safe_time_lock_take(
    p_name text, p_done text, p_marker text, p_token text, p_ttl_ms bigint, p_task_id text,
    p_host text, p_pid integer, p_identity text, p_earlier text[], p_session boolean,
    OUT status text, OUT fence bigint, OUT own boolean, OUT h_task_id text, OUT h_host text, OUT h_pid integer)
LANGUAGE plpgsql AS $$
DECLARE
    cur safe_time_lock%ROWTYPE;
    expires timestamptz;
BEGIN
    -- The fence guard: a session's first acquire after a server start.
    IF current_setting('safe_time.lock_boot', true) IS DISTINCT FROM pg_postmaster_start_time()::text THEN
        PERFORM safe_time_lock_fence_resync();
        PERFORM set_config('safe_time.lock_boot', pg_postmaster_start_time()::text, false);
    ELSIF p_session THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended(p_name, 1));
    IF EXISTS (SELECT 1 FROM safe_time_lock_marker m WHERE m.name IN (p_marker, p_done) AND m.expires_at > now()) THEN
        IF p_marker IS NOT NULL AND EXISTS (
            SELECT 1 FROM safe_time_lock_marker m WHERE m.name = p_marker AND m.expires_at > now()) THEN
            status := 'done';
        ELSE
            status := 'finished';
        END IF;
        own := false;
        RETURN;
    END IF;
    IF p_session AND NOT pg_try_advisory_lock(hashtextextended(p_name, 0)) THEN
        SELECT * INTO cur FROM safe_time_lock l WHERE l.name = p_name;
        status := CASE WHEN cur.identity = p_identity THEN 'duplicate' ELSE 'held' END;
        fence := cur.fence; own := false; h_task_id := cur.task_id; h_host := cur.host; h_pid := cur.pid;
        RETURN;
    END IF;
    expires := CASE WHEN p_session THEN 'infinity'::timestamptz ELSE now() + p_ttl_ms * interval '1 millisecond' END;
    own := false;
    LOOP
        -- A fence from the sequence; the row is new, so this is a new holder.
        INSERT INTO safe_time_lock
            (name, token, task_id, identity, host, pid, fence, acquired_at, renewed_at, expires_at)
        VALUES (p_name, p_token, p_task_id, p_identity, p_host, p_pid, nextval('safe_time_lock_fence'),
            now(), now(), expires)
        ON CONFLICT (name) DO NOTHING
        RETURNING safe_time_lock.fence INTO fence;
        IF FOUND THEN
            status := 'acquired';
            RETURN;
        END IF;
        -- The name is taken: the rules on that row (or, if it went meanwhile, insert again).
        SELECT * INTO cur FROM safe_time_lock l WHERE l.name = p_name FOR UPDATE;
        IF FOUND THEN
            IF p_session OR cur.expires_at > now() THEN
                -- Our own token (a lost reply): nobody ran under it; take it over, same fence.
                IF cur.token = p_token OR cur.token = ANY(p_earlier) THEN
                    UPDATE safe_time_lock SET token = p_token, task_id = p_task_id, identity = p_identity,
                        host = p_host, pid = p_pid, renewed_at = now(), expires_at = expires
                    WHERE name = p_name;
                    status := 'acquired'; fence := cur.fence; own := true;
                    RETURN;
                END IF;
                IF NOT p_session THEN
                    status := CASE WHEN cur.identity = p_identity THEN 'duplicate' ELSE 'held' END;
                    fence := cur.fence; h_task_id := cur.task_id; h_host := cur.host; h_pid := cur.pid;
                    RETURN;
                END IF;
            END IF;
            -- Expired (or, in session mode, left behind by a session that ended): a new holder.
            UPDATE safe_time_lock SET token = p_token, task_id = p_task_id, identity = p_identity, host = p_host,
                pid = p_pid, fence = nextval('safe_time_lock_fence'), acquired_at = now(), renewed_at = now(),
                expires_at = expires
            WHERE name = p_name
            RETURNING safe_time_lock.fence INTO fence;
            status := 'acquired';
            RETURN;
        END IF;
    END LOOP;
END $$

-- The rules of unique_acquire.lua. Returns (status, holder task id, state, stored, ms left).
-- name: unique_claim
CREATE OR REPLACE FUNCTION safe_time_unique_claim(
    p_name text, p_task_id text, p_ttl_ms bigint, p_state text, p_stored boolean, p_host text,
    p_gone text, p_own boolean)
RETURNS TABLE (status text, h_task_id text, h_state text, h_stored boolean, ms_left bigint)
LANGUAGE plpgsql AS $$
DECLARE
    cur safe_time_unique%ROWTYPE;
    expires timestamptz := now() + p_ttl_ms * interval '1 millisecond';
BEGIN
    LOOP
        SELECT * INTO cur FROM safe_time_unique u WHERE u.name = p_name FOR UPDATE;
        IF FOUND THEN
            IF cur.expires_at > now() THEN
                IF cur.task_id = p_task_id AND p_own THEN
                    UPDATE safe_time_unique SET state = p_state, host = p_host, updated_at = now(),
                        expires_at = expires, stored = coalesce(p_stored, stored)
                    WHERE name = p_name;
                    RETURN QUERY SELECT 'own'::text, NULL::text, NULL::text, NULL::boolean, NULL::bigint;
                    RETURN;
                END IF;
                IF p_gone IS NULL OR cur.task_id <> p_gone THEN
                    RETURN QUERY SELECT 'held'::text, cur.task_id, cur.state, cur.stored,
                        (extract(epoch FROM cur.expires_at - now()) * 1000)::bigint;
                    RETURN;
                END IF;
            END IF;
            UPDATE safe_time_unique SET task_id = p_task_id, state = p_state, stored = coalesce(p_stored, false),
                host = p_host, created_at = now(), updated_at = now(), expires_at = expires
            WHERE name = p_name;
            RETURN QUERY SELECT 'acquired'::text, NULL::text, NULL::text, NULL::boolean, NULL::bigint;
            RETURN;
        END IF;
        INSERT INTO safe_time_unique (name, task_id, state, stored, host, created_at, updated_at, expires_at)
        VALUES (p_name, p_task_id, p_state, coalesce(p_stored, false), p_host, now(), now(), expires)
        ON CONFLICT (name) DO NOTHING;
        IF FOUND THEN
            RETURN QUERY SELECT 'acquired'::text, NULL::text, NULL::text, NULL::boolean, NULL::bigint;
            RETURN;
        END IF;
    END LOOP;
END $$

-- rate_limit's sliding logs: one row per admitted call (<prefix>rate:<key>, member "<token>@<start>")
-- or reservation (member "<token>", a call due later) for one period after its time; the rows of a
-- key are trimmed by its next call, the others by the purge.
-- name: rate
CREATE TABLE IF NOT EXISTS safe_time_rate (
    name text NOT NULL,
    member text NOT NULL,
    at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    started timestamptz,
    PRIMARY KEY (name, member)
)

-- name: rate_at
CREATE INDEX IF NOT EXISTS safe_time_rate_at ON safe_time_rate (name, at)

-- name: rate_expires
CREATE INDEX IF NOT EXISTS safe_time_rate_expires ON safe_time_rate (expires_at)

-- The rules of rate_take.lua (celery_safe_time/locks/rates.py). One row per entry of the key's line:
-- a reservation (member = token, at = its due instant, started null) or an admitted call (member =
-- "<token>@<start>", at = the place it was given, started = its real start). A call is admitted while
-- fewer than p_limit calls really started within the last period; new places are counted on the
-- line. Calls of one key take turns on a transaction lock and each reads the clock once it holds it.
-- Returns (admitted, entries on the line, wait in microseconds, its clock in epoch seconds).
-- name: rate_admit
CREATE OR REPLACE FUNCTION safe_time_rate_admit(p_name text, p_token text, p_limit integer, p_period_us bigint,
    p_reserve boolean, OUT admitted boolean, OUT used integer, OUT wait_us bigint, OUT at_epoch double precision)
LANGUAGE plpgsql AS $$
DECLARE
    period interval := p_period_us * interval '1 microsecond';
    t timestamptz;
    floor_t timestamptz;
    own timestamptz;
    due timestamptz;
    started_n integer;
    frees timestamptz;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_name, 1));
    t := clock_timestamp();
    floor_t := t - period;
    at_epoch := extract(epoch FROM t);
    admitted := false;
    -- A row goes once neither its place nor its start is within the period.
    DELETE FROM safe_time_rate r WHERE r.name = p_name AND r.at <= floor_t
        AND (r.started IS NULL OR r.started <= floor_t);
    SELECT count(*) INTO started_n FROM safe_time_rate r WHERE r.name = p_name AND r.started > floor_t;
    IF started_n >= p_limit THEN
        SELECT r.started + period INTO frees FROM safe_time_rate r WHERE r.name = p_name AND r.started > floor_t
        ORDER BY r.started OFFSET started_n - p_limit LIMIT 1;
    END IF;
    SELECT r.at INTO own FROM safe_time_rate r WHERE r.name = p_name AND r.member = p_token;
    IF FOUND AND own > floor_t THEN
        SELECT count(*) INTO used FROM safe_time_rate r WHERE r.name = p_name AND r.at > floor_t;
        IF own > t THEN
            wait_us := greatest(1, ceil(extract(epoch FROM own - t) * 1000000))::bigint;
            RETURN;
        END IF;
        IF started_n < p_limit THEN
            -- Admitted at its place: the place stays where it was given, the start is now.
            UPDATE safe_time_rate r SET member = p_token || '@' || extract(epoch FROM t)::text, started = t,
                expires_at = t + period
            WHERE r.name = p_name AND r.member = p_token;
            admitted := true; wait_us := 0;
            RETURN;
        END IF;
        -- Due, but a call ahead started late and the window of real starts is still full: the call
        -- keeps its place, due again when the start that blocks it ages out.
        wait_us := greatest(1, ceil(extract(epoch FROM frees - t) * 1000000))::bigint;
        RETURN;
    END IF;
    SELECT count(*) INTO used FROM safe_time_rate r WHERE r.name = p_name AND r.at > floor_t;
    IF used < p_limit AND started_n < p_limit THEN
        INSERT INTO safe_time_rate (name, member, at, expires_at, started)
        VALUES (p_name, p_token || '@' || extract(epoch FROM t)::text, t, t + period, t)
        ON CONFLICT DO NOTHING;
        admitted := true; used := used + 1; wait_us := 0;
        RETURN;
    END IF;
    -- The first instant a place frees after every reservation (the entry p_limit places from the end
    -- of the line ages out), and no sooner than the real starts allow.
    due := t;
    IF used >= p_limit THEN
        SELECT greatest(due, r.at + period) INTO due FROM safe_time_rate r WHERE r.name = p_name AND r.at > floor_t
        ORDER BY r.at OFFSET used - p_limit LIMIT 1;
    END IF;
    IF started_n >= p_limit THEN
        due := greatest(due, frees);
    END IF;
    wait_us := greatest(1, ceil(extract(epoch FROM due - t) * 1000000))::bigint;
    IF NOT p_reserve THEN
        RETURN;
    END IF;
    INSERT INTO safe_time_rate (name, member, at, expires_at) VALUES (p_name, p_token, due, due + period)
    ON CONFLICT (name, member) DO UPDATE SET at = EXCLUDED.at, expires_at = EXCLUDED.expires_at, started = NULL;
    used := used + 1;
END $$
