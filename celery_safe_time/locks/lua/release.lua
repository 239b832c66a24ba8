-- KEYS: lock hash. ARGV: token. Deletes the lock only if the token owns it.
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
