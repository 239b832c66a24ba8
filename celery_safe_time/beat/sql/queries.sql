-- The beat backend's statements (PostgresBeatBackend, PostgresLease), by name. A line starting with
-- "-- name:" begins a statement; other lines starting with "--" at column 0 are comments.
--
-- The SQL names its tables literally (no string-built SQL anywhere in the package: the table names
-- in backends/postgres.py are for tests and tools). ``ok`` in the guarded statements is the lease row this
-- token holds, unexpired on the database clock, locked against a take-over until the statement ends.
-- ``mine`` is the fired rows this very call wrote (its ``marker``, new per call: ``state.marker_value``)
-- in an earlier attempt whose reply was lost: the statement sees the rows committed before it, so the
-- same call run again answers "publish" for them, where any later call answers "already fired".
--
-- Two namespaces (safe_time_beat_shards): ``:ns``, the app's key prefix, for what every shard shares
-- (definitions, the change log and counter, run-now requests, fired slots, history, audit, heartbeats),
-- and ``:sns``, the shard's, for what each shard leads alone (the lease row, the state rows and their
-- counts, the applied marker, the pause expiries). Shard 0's ``:sns`` is ``:ns``: one leader's rows.

-- name: acquire
INSERT INTO safe_time_beat_lease AS l (ns, token, epoch, expires_at, info)
VALUES (:sns, :token, 1, clock_timestamp() + make_interval(secs => :ttl), :info)
ON CONFLICT (ns) DO UPDATE SET
    token = EXCLUDED.token,
    epoch = CASE WHEN l.token = EXCLUDED.token AND l.expires_at > clock_timestamp() THEN l.epoch ELSE l.epoch + 1 END,
    info = CASE WHEN l.token = EXCLUDED.token AND l.expires_at > clock_timestamp() THEN l.info ELSE EXCLUDED.info END,
    expires_at = EXCLUDED.expires_at
WHERE l.token IS NULL OR l.expires_at IS NULL OR l.expires_at <= clock_timestamp() OR l.token = EXCLUDED.token
RETURNING epoch

-- name: renew
UPDATE safe_time_beat_lease SET expires_at = clock_timestamp() + make_interval(secs => :ttl)
WHERE ns = :sns AND token = :token AND epoch = :epoch AND expires_at > clock_timestamp()

-- name: release
UPDATE safe_time_beat_lease SET token = NULL, expires_at = NULL, info = NULL WHERE ns = :sns AND token = :token

-- name: write_slots
WITH ok AS (SELECT epoch FROM safe_time_beat_lease
    WHERE ns = :sns AND token = :token AND epoch = :epoch AND expires_at > clock_timestamp() FOR SHARE),
w AS (
    SELECT * FROM unnest(
        CAST(:entries AS text[]), CAST(:slots AS bigint[]), CAST(:states AS text[]), CAST(:nexts AS float8[]),
        CAST(:histories AS text[])
    ) WITH ORDINALITY AS w(entry, slot_ms, state, next_fire, history, ord)
),
mine AS (
    SELECT f.entry, f.slot_ms FROM safe_time_beat_fired f
    WHERE f.ns = :ns AND f.marker = :marker AND (f.entry, f.slot_ms) IN (SELECT entry, slot_ms FROM w)
),
fired AS (
    INSERT INTO safe_time_beat_fired (ns, entry, slot_ms, epoch, marker)
    SELECT :ns, w.entry, w.slot_ms, :epoch, :marker FROM w, ok WHERE w.slot_ms IS NOT NULL
    ON CONFLICT DO NOTHING
    RETURNING entry, slot_ms
),
latest AS (SELECT DISTINCT ON (entry) entry, state, next_fire FROM w ORDER BY entry, ord DESC),
written AS (
    INSERT INTO safe_time_beat_state (ns, entry, state, next_fire)
    SELECT :sns, latest.entry, latest.state, latest.next_fire FROM latest, ok
    ON CONFLICT (ns, entry) DO UPDATE SET state = EXCLUDED.state, next_fire = EXCLUDED.next_fire
    RETURNING 1
),
-- the run records of the slots to publish (history.py); :history_size 0 writes none
recorded AS (
    INSERT INTO safe_time_beat_history (ns, entry, slot_ms, record)
    SELECT :ns, w.entry, w.slot_ms, w.history
    FROM w JOIN (SELECT entry, slot_ms FROM fired UNION ALL SELECT entry, slot_ms FROM mine) f
        ON f.entry = w.entry AND f.slot_ms = w.slot_ms
    WHERE w.history IS NOT NULL AND :history_size > 0
    ON CONFLICT (ns, entry, slot_ms) DO NOTHING
    RETURNING entry
),
-- the statement sees the table as it was before it: keep the newest history_size - 1 old runs per
-- entry recorded now, with the new one that makes history_size
trimmed AS (
    DELETE FROM safe_time_beat_history h
    USING (SELECT DISTINCT entry FROM recorded) r
    WHERE h.ns = :ns AND h.entry = r.entry AND h.slot_ms <= (
        SELECT k.slot_ms FROM safe_time_beat_history k WHERE k.ns = :ns AND k.entry = r.entry
        ORDER BY k.slot_ms DESC OFFSET GREATEST(:history_size - 1, 0) LIMIT 1
    )
    RETURNING 1
)
SELECT (SELECT count(*) FROM ok) AS leader,
       (SELECT count(*) FROM mine) AS mine,
       (SELECT json_agg(json_build_array(entry, slot_ms))
        FROM (SELECT entry, slot_ms FROM fired UNION ALL SELECT entry, slot_ms FROM mine) f) AS fresh

-- name: dispatch_slot
WITH ok AS (SELECT epoch FROM safe_time_beat_lease
    WHERE ns = :sns AND token = :token AND epoch = :epoch AND expires_at > clock_timestamp() FOR SHARE),
mine AS (
    SELECT 1 FROM safe_time_beat_fired
    WHERE ns = :ns AND entry = :entry AND slot_ms = :slot_ms AND marker = :marker
),
fired AS (
    INSERT INTO safe_time_beat_fired (ns, entry, slot_ms, epoch, marker)
    SELECT :ns, :entry, :slot_ms, :epoch, :marker FROM ok
    ON CONFLICT DO NOTHING RETURNING 1
)
SELECT (SELECT count(*) FROM ok), (SELECT count(*) FROM mine), (SELECT count(*) FROM fired)

-- name: forget
WITH ok AS (SELECT epoch FROM safe_time_beat_lease
    WHERE ns = :sns AND token = :token AND epoch = :epoch AND expires_at > clock_timestamp() FOR SHARE),
unscheduled AS (
    UPDATE safe_time_beat_state SET next_fire = NULL
    WHERE ns = :sns AND entry = ANY(CAST(:names AS text[])) AND :keep AND EXISTS (SELECT 1 FROM ok)
    RETURNING 1
),
removed AS (
    DELETE FROM safe_time_beat_state
    WHERE ns = :sns AND entry = ANY(CAST(:names AS text[])) AND NOT :keep AND EXISTS (SELECT 1 FROM ok)
    RETURNING 1
)
SELECT (SELECT count(*) FROM ok), (SELECT count(*) FROM unscheduled) + (SELECT count(*) FROM removed)

-- One idle tick's read: the due entries (kind 0), the head (1), the due count (2), the state count (3)
-- (both from ``safe_time_beat_counts``: no count of the table), the runtime entries' change counter (4).
-- Where the counts (the same snapshot) say no entry is due, the due index is not read: after a mass
-- delete it holds dead entries until vacuum, and finding no head walked every one of them (1.1 s for
-- a million state rows deleted by hand).
-- name: read_due
(SELECT entry, next_fire, 0 AS kind FROM safe_time_beat_state
    WHERE ns = :sns AND next_fire IS NOT NULL AND next_fire <= :now
        AND NOT EXISTS (SELECT 1 FROM safe_time_beat_counts WHERE ns = :sns AND due = 0)
    ORDER BY next_fire, entry LIMIT :limit)
UNION ALL
(SELECT entry, next_fire, 1 FROM safe_time_beat_state
    WHERE ns = :sns AND next_fire IS NOT NULL
        AND NOT EXISTS (SELECT 1 FROM safe_time_beat_counts WHERE ns = :sns AND due = 0)
    ORDER BY next_fire, entry LIMIT 1)
UNION ALL
SELECT NULL, (SELECT due FROM safe_time_beat_counts WHERE ns = :sns), 2
UNION ALL
SELECT NULL, (SELECT total FROM safe_time_beat_counts WHERE ns = :sns), 3
UNION ALL
SELECT NULL, (SELECT version FROM safe_time_beat_meta WHERE ns = :ns), 4

-- name: head
SELECT entry, next_fire FROM safe_time_beat_state
    WHERE ns = :sns AND next_fire IS NOT NULL ORDER BY next_fire, entry LIMIT :limit

-- name: lease_view
SELECT l.token, l.epoch, l.info,
       CASE WHEN l.expires_at > n.now THEN ceil(extract(epoch FROM l.expires_at - n.now) * 1000) END AS ttl_ms,
       extract(epoch FROM n.now) AS now
FROM (SELECT clock_timestamp() AS now) n LEFT JOIN safe_time_beat_lease l ON l.ns = :sns

-- name: now
SELECT extract(epoch FROM clock_timestamp())

-- The backend's other statements, by the method that runs them.

-- name: schema_lock
SELECT pg_advisory_xact_lock(:key)

-- Whether every table, index, function, trigger and added column of schema.sql is there. A beat that
-- finds them all runs no DDL: a CREATE INDEX IF NOT EXISTS still takes its table's SHARE lock first,
-- so it waits behind a long write and deadlocks with a writer of two tables.
-- name: schema_present
SELECT (SELECT count(*) FROM unnest(CAST(:relations AS text[])) AS r (name) WHERE to_regclass(r.name) IS NOT NULL)
       = cardinality(CAST(:relations AS text[]))
   AND (SELECT count(*) FROM unnest(CAST(:functions AS text[])) AS f (name) WHERE to_regproc(f.name) IS NOT NULL)
       = cardinality(CAST(:functions AS text[]))
   AND (SELECT count(*) FROM pg_trigger t JOIN unnest(CAST(:triggers AS text[]), CAST(:trigger_tables AS text[]))
            AS g (name, tab) ON t.tgname = g.name AND t.tgrelid = to_regclass(g.tab))
       = cardinality(CAST(:triggers AS text[]))

-- name: holds_lease
SELECT 1 FROM safe_time_beat_lease WHERE ns = :sns AND token = :token AND expires_at > clock_timestamp()

-- name: drop_due
UPDATE safe_time_beat_state SET next_fire = NULL WHERE ns = :sns AND entry = :entry

-- name: snapshot_meta
SELECT (SELECT version FROM safe_time_beat_meta WHERE ns = :ns), (SELECT applied FROM safe_time_beat_meta WHERE ns = :sns)

-- name: snapshot_entries
SELECT name, definition FROM safe_time_beat_entries WHERE ns = :ns

-- name: snapshot_run_now
SELECT name, slot_ms FROM safe_time_beat_run_now WHERE ns = :ns

-- name: all_states
SELECT entry, state, next_fire FROM safe_time_beat_state WHERE ns = :sns

-- name: change_count
SELECT count(*) FROM safe_time_beat_changes WHERE ns = :ns

-- name: read_states
SELECT entry, state, next_fire FROM safe_time_beat_state WHERE ns = :sns AND entry = ANY(CAST(:names AS text[]))

-- name: due_count
SELECT coalesce((SELECT due FROM safe_time_beat_counts WHERE ns = :sns), 0)

-- name: plan_states
INSERT INTO safe_time_beat_state (ns, entry, state, next_fire)
SELECT :sns, * FROM unnest(
    CAST(:names AS text[]), CAST(:states AS text[]), CAST(:nexts AS float8[]))
ON CONFLICT (ns, entry) DO UPDATE SET state = EXCLUDED.state, next_fire = EXCLUDED.next_fire

-- name: plan_gone
DELETE FROM safe_time_beat_state WHERE ns = :sns AND entry = ANY(CAST(:names AS text[]))

-- name: plan_idle
UPDATE safe_time_beat_state SET next_fire = NULL WHERE ns = :sns AND entry = ANY(CAST(:names AS text[]))

-- name: holds_lease_for_plan
SELECT 1 FROM safe_time_beat_lease WHERE ns = :sns AND token = :token AND expires_at > clock_timestamp() FOR SHARE

-- name: change_log
SELECT name, version FROM safe_time_beat_changes WHERE ns = :ns AND version > :since ORDER BY version, name LIMIT :limit

-- name: read_changed_definitions
SELECT name, definition FROM safe_time_beat_entries WHERE ns = :ns AND name = ANY(CAST(:names AS text[]))

-- name: prune_changes
DELETE FROM safe_time_beat_changes c
WHERE c.ns = :ns AND c.name = ANY(CAST(:names AS text[])) AND c.version <= :version
AND NOT EXISTS (SELECT 1 FROM safe_time_beat_entries e WHERE e.ns = c.ns AND e.name = c.name)

-- name: mark_applied
INSERT INTO safe_time_beat_meta (ns, version, applied)
SELECT :sns, 0, :marker WHERE EXISTS (
    SELECT 1 FROM safe_time_beat_lease
    WHERE ns = :sns AND token = :token AND expires_at > clock_timestamp())
ON CONFLICT (ns) DO UPDATE SET applied = EXCLUDED.applied

-- name: run_now_done
DELETE FROM safe_time_beat_run_now WHERE ns = :ns AND name = :name AND slot_ms = :slot_ms

-- name: meta_row
INSERT INTO safe_time_beat_meta (ns) VALUES (:ns) ON CONFLICT DO NOTHING

-- name: lock_version
SELECT version FROM safe_time_beat_meta WHERE ns = :ns FOR UPDATE

-- name: set_version
UPDATE safe_time_beat_meta SET version = :v WHERE ns = :ns

-- name: log_change
INSERT INTO safe_time_beat_changes (ns, name, version) VALUES (:ns, :name, :v)
ON CONFLICT (ns, name) DO UPDATE SET version = EXCLUDED.version

-- name: definition
SELECT definition FROM safe_time_beat_entries WHERE ns = :ns AND name = :name

-- name: put_definition
INSERT INTO safe_time_beat_entries (ns, name, definition) VALUES (:ns, :name, :raw)
ON CONFLICT (ns, name) DO UPDATE SET definition = EXCLUDED.definition

-- save_entries: a chunk of distinct names in one statement, under the counter row's lock (:version
-- its value). The chunk comes as one JSON array of [name, definition] pairs (a text array literal
-- escapes each quote of a definition on the client, the costliest part of the call). Each name's
-- stored definition is one primary key lookup (a LATERAL subquery with LIMIT, which the planner keeps
-- as one: a join or "= ANY" would scan the whole namespace while the tables have no statistics yet,
-- as in a first import); an unchanged definition writes nothing. The changed ones are upserted,
-- logged with their versions in the chunk's order, and audited: the record built here from
-- :audit_head (the audit JSON object without its closing brace) and the definitions, so a definition
-- crosses the wire once; each name keeps its :keep newest earlier records (the statement does not
-- see the ones it adds, one per name). Returns the changed items' positions (from 1) and versions.
-- name: save_definitions
WITH input AS (
    SELECT t.ord, t.item ->> 0 AS name, t.item ->> 1 AS raw
    FROM json_array_elements(CAST(:items AS json)) WITH ORDINALITY AS t(item, ord)
),
stored AS (
    SELECT i.ord, i.name, i.raw, e.definition AS old FROM input i LEFT JOIN LATERAL (
        SELECT definition FROM safe_time_beat_entries WHERE ns = :ns AND name = i.name LIMIT 1
    ) e ON true
),
changed AS (
    SELECT s.ord, s.name, s.raw, s.old, CAST(:version AS bigint) + row_number() OVER (ORDER BY s.ord) AS version
    FROM stored s WHERE s.old IS DISTINCT FROM s.raw
),
put AS (
    INSERT INTO safe_time_beat_entries (ns, name, definition) SELECT :ns, c.name, c.raw FROM changed c
    ON CONFLICT (ns, name) DO UPDATE SET definition = EXCLUDED.definition
),
logged AS (
    INSERT INTO safe_time_beat_changes (ns, name, version) SELECT :ns, c.name, c.version FROM changed c
    ON CONFLICT (ns, name) DO UPDATE SET version = EXCLUDED.version
),
audited AS (
    INSERT INTO safe_time_beat_audit (ns, name, record)
    SELECT :ns, c.name, CAST(:audit_head AS text) || ',"old":' || coalesce(c.old, 'null') || ',"new":' || c.raw
        || ',"version":' || c.version || '}'
    FROM changed c WHERE CAST(:audited AS boolean) ORDER BY c.ord
),
trimmed AS (
    DELETE FROM safe_time_beat_audit a
    USING (
        SELECT c.name, o.id FROM changed c CROSS JOIN LATERAL (
            SELECT id FROM safe_time_beat_audit WHERE ns = :ns AND name = c.name ORDER BY id DESC OFFSET :keep
        ) o WHERE CAST(:audited AS boolean)
    ) old
    WHERE a.ns = :ns AND a.name = old.name AND a.id = old.id
),
bumped AS (
    UPDATE safe_time_beat_meta SET version = CAST(:version AS bigint) + (SELECT count(*) FROM changed)
    WHERE ns = :ns AND EXISTS (SELECT 1 FROM changed)
)
SELECT ord, version FROM changed ORDER BY ord

-- save_entries with a name twice in its chunk (compared in Python, one after the other): the chunk's
-- stored definitions (a lookup per name, as above, a subplan each), then its definitions, change log rows and audit
-- records, one statement each (the names distinct; the records in the order of their versions), and
-- each name's audit trimmed to :audit_size (the statement sees the records just added; a lookup per name).
-- name: stored_definitions
SELECT i.name, (SELECT e.definition FROM safe_time_beat_entries e WHERE e.ns = :ns AND e.name = i.name)
FROM unnest(CAST(:names AS text[])) AS i(name)

-- name: put_definitions
INSERT INTO safe_time_beat_entries (ns, name, definition)
SELECT :ns, * FROM unnest(CAST(:names AS text[]), CAST(:raws AS text[]))
ON CONFLICT (ns, name) DO UPDATE SET definition = EXCLUDED.definition

-- name: log_changes
INSERT INTO safe_time_beat_changes (ns, name, version)
SELECT :ns, * FROM unnest(CAST(:names AS text[]), CAST(:versions AS bigint[]))
ON CONFLICT (ns, name) DO UPDATE SET version = EXCLUDED.version

-- name: audit_append_many
INSERT INTO safe_time_beat_audit (ns, name, record)
SELECT :ns, a.name, a.record FROM unnest(CAST(:names AS text[]), CAST(:records AS text[]))
    WITH ORDINALITY AS a(name, record, ord)
ORDER BY a.ord

-- name: audit_trim_many
DELETE FROM safe_time_beat_audit a
USING (
    SELECT n.name, o.id FROM unnest(CAST(:names AS text[])) AS n(name) CROSS JOIN LATERAL (
        SELECT id FROM safe_time_beat_audit WHERE ns = :ns AND name = n.name ORDER BY id DESC OFFSET :audit_size
    ) o
) old
WHERE a.ns = :ns AND a.name = old.name AND a.id = old.id

-- A deletion is noted with its time: the leader's prune_deleted reads these rows, not every audit record.
-- name: delete_definition
WITH gone AS (DELETE FROM safe_time_beat_entries WHERE ns = :ns AND name = :name RETURNING name),
noted AS (
    INSERT INTO safe_time_beat_deleted (ns, name, deleted_at)
    SELECT :ns, gone.name, extract(epoch FROM clock_timestamp()) FROM gone
    ON CONFLICT (ns, name) DO UPDATE SET deleted_at = EXCLUDED.deleted_at
    RETURNING 1
)
SELECT 1 FROM gone

-- name: run_now
INSERT INTO safe_time_beat_run_now (ns, name, slot_ms) VALUES (:ns, :name, :slot_ms)
ON CONFLICT (ns, name) DO UPDATE SET slot_ms = EXCLUDED.slot_ms

-- name: definitions
SELECT name, definition FROM safe_time_beat_entries WHERE ns = :ns AND left(name, length(:prefix)) = :prefix

-- The operator views' pages and counts (beat list, status, the admin), each on an index.
-- name: entry_page
SELECT name, definition FROM safe_time_beat_entries
WHERE ns = :ns AND name COLLATE "C" > :after
ORDER BY name COLLATE "C" LIMIT :limit

-- name: entry_page_prefix
SELECT name, definition FROM safe_time_beat_entries
WHERE ns = :ns AND name COLLATE "C" > :after AND name COLLATE "C" >= :low AND name COLLATE "C" < :high
    AND starts_with(name, :low)
ORDER BY name COLLATE "C" LIMIT :limit

-- name: definition_count
SELECT coalesce((SELECT total FROM safe_time_beat_entry_counts WHERE ns = :ns), 0)

-- name: entry_counts
SELECT coalesce((SELECT total FROM safe_time_beat_entry_counts WHERE ns = :ns), 0),
    coalesce((SELECT sum(due) FROM safe_time_beat_counts WHERE ns = ANY(CAST(:shard_nss AS text[]))), 0),
    (SELECT count(*) FROM safe_time_beat_state
     WHERE ns = ANY(CAST(:shard_nss AS text[])) AND next_fire IS NOT NULL AND next_fire <= :soon)

-- name: change_versions
SELECT name, version FROM safe_time_beat_changes WHERE ns = :ns AND name = ANY(CAST(:names AS text[]))

-- What a save plans for changed entries (backends/base.py, entry_save): a state and due time of
-- each, in its shard's ns, where the entry has none or one that never fired (UNFIRED_STATE_PREFIX).
-- :items is a JSON array of [name, seed, version, shard ns] (seed: the position from 0 in :seeds, a
-- JSON array of distinct [state, due] pairs; shard ns: null for :sns). A bulk save writes them after
-- its chunk commits, on a connection of its own, so each name's change log row must still hold the
-- version its save gave it (a later save plans its own); a row another writer holds is skipped
-- rather than waited for, as that save's own seed follows.
-- name: seed_states
INSERT INTO safe_time_beat_state AS s (ns, entry, state, next_fire)
SELECT coalesce(t.item ->> 3, :sns), t.item ->> 0, d.item ->> 0, CAST(d.item ->> 1 AS double precision)
FROM json_array_elements(CAST(:items AS json)) AS t(item)
JOIN json_array_elements(CAST(:seeds AS json)) WITH ORDINALITY AS d(item, ord)
    ON d.ord = CAST(t.item ->> 1 AS integer) + 1
JOIN LATERAL (
    SELECT 1 FROM safe_time_beat_changes c
    WHERE c.ns = :ns AND c.name = t.item ->> 0 AND c.version = CAST(t.item ->> 2 AS bigint)
    FOR SHARE SKIP LOCKED
) held ON true
ON CONFLICT (ns, entry) DO UPDATE SET state = EXCLUDED.state, next_fire = EXCLUDED.next_fire
WHERE left(s.state, 15) = :unfired

-- name: seed_state
INSERT INTO safe_time_beat_state (ns, entry, state, next_fire) VALUES (:sns, :entry, :state, NULL) ON CONFLICT DO NOTHING

-- name: slot_fired
SELECT 1 FROM safe_time_beat_fired WHERE ns = :ns AND entry = :entry AND slot_ms = :slot_ms

-- A backfill's claim (no lease: epoch 0): the slots this call marked, its earlier attempts' included.
-- name: claim_slots
WITH w AS (SELECT DISTINCT unnest(CAST(:slots AS bigint[])) AS slot_ms),
mine AS (
    SELECT f.slot_ms FROM safe_time_beat_fired f
    WHERE f.ns = :ns AND f.entry = :entry AND f.marker = :marker AND f.slot_ms IN (SELECT slot_ms FROM w)
),
fired AS (
    INSERT INTO safe_time_beat_fired (ns, entry, slot_ms, epoch, marker)
    SELECT :ns, :entry, w.slot_ms, 0, :marker FROM w
    ON CONFLICT DO NOTHING
    RETURNING slot_ms
)
SELECT slot_ms FROM fired UNION SELECT slot_ms FROM mine

-- name: prune_fired
DELETE FROM safe_time_beat_fired WHERE ns = :ns
AND fired_at < clock_timestamp() - make_interval(secs => :ttl)
AND EXISTS (SELECT 1 FROM safe_time_beat_lease
            WHERE ns = :sns AND token = :token AND expires_at > clock_timestamp())

-- The run history and the change audit (history.py).
-- name: history_record
WITH recorded AS (
    INSERT INTO safe_time_beat_history (ns, entry, slot_ms, record) VALUES (:ns, :entry, :slot_ms, :record)
    ON CONFLICT (ns, entry, slot_ms) DO UPDATE SET record = EXCLUDED.record
    RETURNING 1
)
DELETE FROM safe_time_beat_history h
USING (
    SELECT slot_ms FROM (
        SELECT slot_ms, row_number() OVER (ORDER BY slot_ms DESC) AS r
        FROM safe_time_beat_history WHERE ns = :ns AND entry = :entry AND slot_ms <> :slot_ms
    ) ranked WHERE r >= :history_size
) old
WHERE h.ns = :ns AND h.entry = :entry AND h.slot_ms = old.slot_ms AND EXISTS (SELECT 1 FROM recorded)

-- name: history_outcome
UPDATE safe_time_beat_history SET outcome = :outcome WHERE ns = :ns AND entry = :entry AND slot_ms = :slot_ms

-- name: history_read
SELECT record, outcome FROM safe_time_beat_history WHERE ns = :ns AND entry = :entry
ORDER BY slot_ms DESC LIMIT :limit

-- name: audit_append
WITH added AS (
    INSERT INTO safe_time_beat_audit (ns, name, record) VALUES (:ns, :name, :record) RETURNING id
)
DELETE FROM safe_time_beat_audit a
USING (
    SELECT id FROM (
        SELECT id, row_number() OVER (ORDER BY id DESC) AS r
        FROM safe_time_beat_audit WHERE ns = :ns AND name = :name
    ) ranked WHERE r >= :audit_size
) old
WHERE a.ns = :ns AND a.name = :name AND a.id = old.id AND EXISTS (SELECT 1 FROM added)

-- name: audit_read
SELECT record FROM safe_time_beat_audit WHERE ns = :ns AND name = :name ORDER BY id DESC LIMIT :limit

-- The runs and changes of entries deleted more than :keep seconds ago and not saved again (their
-- deletion noted in safe_time_beat_deleted, which holds only the deletions not yet pruned: the
-- statement never reads every audit record); leader only, with prune_fired.
-- name: prune_deleted
WITH ok AS (SELECT 1 FROM safe_time_beat_lease
    WHERE ns = :sns AND token = :token AND expires_at > clock_timestamp()),
expired AS (
    DELETE FROM safe_time_beat_deleted d USING ok
    WHERE d.ns = :ns AND d.deleted_at < extract(epoch FROM clock_timestamp()) - :keep
    RETURNING d.name
),
gone AS (
    SELECT expired.name FROM expired
    WHERE NOT EXISTS (SELECT 1 FROM safe_time_beat_entries e WHERE e.ns = :ns AND e.name = expired.name)
),
runs AS (
    DELETE FROM safe_time_beat_history h USING gone WHERE h.ns = :ns AND h.entry = gone.name RETURNING 1
)
DELETE FROM safe_time_beat_audit a USING gone WHERE a.ns = :ns AND a.name = gone.name

-- A leader reading only what is due (postgres_reads.py): keyset pages of the definitions and of the
-- planned names (each on its primary key), and the pause expiries it resumes.
-- name: scan_definitions
SELECT name, definition FROM safe_time_beat_entries WHERE ns = :ns AND name > :after ORDER BY name LIMIT :limit

-- name: scan_planned
SELECT entry FROM safe_time_beat_state WHERE ns = :sns AND entry > :after ORDER BY entry LIMIT :limit

-- name: pause_expiries
SELECT name, resume_at FROM safe_time_beat_pause_expiry WHERE ns = :sns

-- name: pause_expiries_drop
DELETE FROM safe_time_beat_pause_expiry WHERE ns = :sns AND (:every OR name = ANY(CAST(:names AS text[])))

-- name: pause_expiries_add
INSERT INTO safe_time_beat_pause_expiry (ns, name, resume_at)
SELECT :sns, * FROM unnest(CAST(:names AS text[]), CAST(:ats AS float8[]))
ON CONFLICT (ns, name) DO UPDATE SET resume_at = EXCLUDED.resume_at

-- Sharded firing (beat/shards.py): each beat's heartbeat row (its pulse, shards.BeatPulse, and when it
-- was seen on the beat's clock); rows older than :window are deleted by whichever beat looks. The
-- statement sees the table as it was before it: this beat's own row comes from the upsert.
-- name: beats_heartbeat
WITH mine AS (
    INSERT INTO safe_time_beat_beats AS b (ns, member, seen_at, pulse) VALUES (:ns, :member, :now, :pulse)
    ON CONFLICT (ns, member) DO UPDATE SET seen_at = EXCLUDED.seen_at, pulse = EXCLUDED.pulse
    RETURNING member, pulse
),
gone AS (
    DELETE FROM safe_time_beat_beats WHERE ns = :ns AND member <> :member AND seen_at < :now - :window
    RETURNING 1
)
SELECT member, pulse FROM safe_time_beat_beats WHERE ns = :ns AND member <> :member AND seen_at >= :now - :window
UNION ALL
SELECT member, pulse FROM mine

-- name: beats_seen
SELECT member, pulse FROM safe_time_beat_beats WHERE ns = :ns

-- name: beats_gone
DELETE FROM safe_time_beat_beats WHERE ns = :ns AND member = :member
