-- KEYS: history hash, history slots zset. ARGV: slot ms, record json, history size.
-- A run record written outside a dispatch (a backfill's slot): as dispatch.lua writes it, the
-- entry's oldest runs beyond the history size dropped (record_history, from _history.lua).
record_history(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3])
return 1
