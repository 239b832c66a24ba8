-- KEYS: entries hash, version counter, change log zset[, audit list]. ARGV: entry name, definition json[,
-- audit record json without its definitions, audit size].
-- Upsert of a runtime entry; any client may call it (EVAL). An identical definition changes
-- nothing and returns 0 (six processes saving the same entry at start-up make one change);
-- otherwise the new version, which the leader sees in the change log at its next tick. With an
-- audit list, the change appends its record there with the definition it replaced (history.py).
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old == ARGV[2] then return 0 end
local version = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[3], version, ARGV[1])
if KEYS[4] then
  redis.call('LPUSH', KEYS[4], string.sub(ARGV[3], 1, -2) .. ',"old":' .. (old or 'null') .. ',"new":' .. ARGV[2] .. ',"version":' .. version .. '}')
  redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[4]) - 1)
end
return version
