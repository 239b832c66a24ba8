-- KEYS: entries hash, change log zset, name index zset, name index version, change counter.
-- ARGV: most change log members applied in this call.
-- Brings the name index (every runtime entry's name at score 0, read with ZRANGEBYLEX by the
-- operator views) up to the change log: each name changed after the index's version is added when
-- its definition exists and removed when it does not. The writers' scripts do not know the index;
-- a name whose tombstone was pruned before this ran stays until a page finds it gone (drop_names.lua).
-- Returns {applied, more (1: call again), index size, definitions}.
local synced = tonumber(redis.call('GET', KEYS[4]) or '0')
local version = tonumber(redis.call('GET', KEYS[5]) or '0')
if synced > version then
  -- the counter started again (its key was deleted): the index is built again from the whole log
  synced = 0
end
local limit = tonumber(ARGV[1])
local changed = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. string.format('%d', synced), '+inf', 'WITHSCORES', 'LIMIT', 0, limit)
local applied = #changed / 2
for i = 1, #changed, 2 do
  local name = changed[i]
  if redis.call('HEXISTS', KEYS[1], name) == 1 then
    redis.call('ZADD', KEYS[3], 0, name)
  else
    redis.call('ZREM', KEYS[3], name)
  end
  synced = tonumber(changed[i + 1])
end
if applied > 0 or redis.call('EXISTS', KEYS[4]) == 0 then
  redis.call('SET', KEYS[4], string.format('%d', synced))
end
return {applied, applied == limit and 1 or 0, redis.call('ZCARD', KEYS[3]), redis.call('HLEN', KEYS[1])}
