-- KEYS: entries hash, version counter, change log zset[, audit list, history hash, history slots zset[,
-- state hash, due zset of the entry's shard]].
-- ARGV: entry name, definition json[, audit record json without its definitions ("": none), audit size[,
-- seed state json ("": none), seed due score]].
-- Upsert of a runtime entry; any client may call it (EVAL). An identical definition changes
-- nothing and returns 0 (six processes saving the same entry at start-up make one change);
-- otherwise the new version, which the leader sees in the change log at its next tick. With the
-- history keys (history.py), the change appends its audit record with the definition it replaced,
-- and a name saved again after a delete keeps its runs and changes (the delete set them to expire).
-- With a seed, a changed entry that has no state, or one that never fired, gets the seed's state and
-- due score (its first slot): a leader that never planned it finds it due (backends/base.py).
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old == ARGV[2] then return 0 end
local version = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[3], version, ARGV[1])
if KEYS[4] then
  if ARGV[3] and ARGV[3] ~= '' then
    redis.call('LPUSH', KEYS[4], string.sub(ARGV[3], 1, -2) .. ',"old":' .. (old or 'null') .. ',"new":' .. ARGV[2] .. ',"version":' .. version .. '}')
    redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[4]) - 1)
  end
  if not old then
    for i = 4, 6 do redis.call('PERSIST', KEYS[i]) end
  end
end
if ARGV[5] and ARGV[5] ~= '' then
  local state = redis.call('HGET', KEYS[7], ARGV[1])
  if not state or string.sub(state, 1, 15) == '{"last": null, ' then
    redis.call('HSET', KEYS[7], ARGV[1], ARGV[5])
    redis.call('ZADD', KEYS[8], ARGV[6], ARGV[1])
  end
end
return version
