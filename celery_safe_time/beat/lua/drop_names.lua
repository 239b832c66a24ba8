-- KEYS: entries hash, name index zset. ARGV: names.
-- Drops from the name index the names that have no definition (deleted, their tombstone pruned
-- before the index saw it); a name saved again meanwhile stays. Returns how many were dropped.
local dropped = 0
for i = 1, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then
    dropped = dropped + redis.call('ZREM', KEYS[2], ARGV[i])
  end
end
return dropped
