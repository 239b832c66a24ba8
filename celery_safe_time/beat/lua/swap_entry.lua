-- KEYS: entries hash, version counter, change log zset[, audit list]. ARGV: entry name, expected
-- definition json, new json[, audit record json without its definitions, audit size].
-- Compare-and-set of one runtime entry's definition (pause, resume, a fired one-off disabling itself):
-- writes only while the stored definition is still the one the caller read, so a save_entry that landed
-- in between is never overwritten by a stale copy. Returns -1 (changed or deleted meanwhile: read it
-- again), 0 (already as asked: nothing changes) or the new version (the leader applies it next tick).
-- With an audit list, a change appends its record there (history.py).
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return -1 end
if ARGV[2] == ARGV[3] then return 0 end
local version = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[3], version, ARGV[1])
if KEYS[4] then
  redis.call('LPUSH', KEYS[4], string.sub(ARGV[4], 1, -2) .. ',"old":' .. ARGV[2] .. ',"new":' .. ARGV[3] .. ',"version":' .. version .. '}')
  redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[5]) - 1)
end
return version
