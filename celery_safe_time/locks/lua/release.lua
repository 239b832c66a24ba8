-- KEYS: lock hash[, finished-delivery marker]. ARGV: token[, marker ttl ms, task id].
-- Deletes the lock only if the token owns it. The marker is written either way: the delivery has
-- ended (even if its lock was lost meanwhile), so a late redelivery of it must not run again.
if KEYS[2] then
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
end
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
