-- KEYS: entries hash, version counter, change log zset. ARGV: entry name.
-- Deletes a runtime entry; its change log member stays as a tombstone with the new version so
-- the leader drops it at its next tick. 0 when there was no such entry.
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
local version = redis.call('INCR', KEYS[2])
redis.call('ZADD', KEYS[3], version, ARGV[1])
return version
