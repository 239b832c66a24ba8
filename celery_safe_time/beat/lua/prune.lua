-- KEYS: entries hash, change log zset. ARGV: version, names...
-- Drops tombstones (change log members of deleted entries) up to ``version``: only names that
-- are still deleted and were not changed again since, so no later change is ever lost.
local dropped = 0
for i = 2, #ARGV do
  local score = redis.call('ZSCORE', KEYS[2], ARGV[i])
  if score and tonumber(score) <= tonumber(ARGV[1]) and redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then
    redis.call('ZREM', KEYS[2], ARGV[i])
    dropped = dropped + 1
  end
end
return dropped
