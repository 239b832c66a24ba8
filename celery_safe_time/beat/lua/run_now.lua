-- KEYS: run-now hash, version counter. ARGV: entry name, requested slot (ms).
-- Asks the leader to publish one extra slot of an entry (through the dispatch guard, so the
-- request is published at most once whichever beat leads). Returns the new version.
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return redis.call('INCR', KEYS[2])
