-- KEYS: entries hash, version counter, change log zset[, audit list, history hash, history slots zset].
-- ARGV: entry name[, audit record json without its definitions ("": none), audit size, keep ms].
-- Deletes a runtime entry; its change log member stays as a tombstone with the new version so
-- the leader drops it at its next tick. 0 when there was no such entry. With the history keys
-- (history.py), the deletion appends its audit record with the deleted definition, and the
-- entry's runs and changes expire after the keep time (unless the name is saved again).
local old = redis.call('HGET', KEYS[1], ARGV[1])
if not old then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
local version = redis.call('INCR', KEYS[2])
redis.call('ZADD', KEYS[3], version, ARGV[1])
if KEYS[4] then
  if ARGV[2] ~= '' then
    redis.call('LPUSH', KEYS[4], string.sub(ARGV[2], 1, -2) .. ',"old":' .. old .. ',"new":null,"version":' .. version .. '}')
    redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[3]) - 1)
  end
  for i = 4, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[4]) end
end
return version
