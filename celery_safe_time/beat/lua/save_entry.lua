-- KEYS: entries hash, version counter, change log zset. ARGV: entry name, definition json.
-- Upsert of a runtime entry; any client may call it (EVAL). An identical definition changes
-- nothing and returns 0 (six processes saving the same entry at start-up make one change);
-- otherwise the new version, which the leader sees in the change log at its next tick.
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return 0 end
local version = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[3], version, ARGV[1])
return version
