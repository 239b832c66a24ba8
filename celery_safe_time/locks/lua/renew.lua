-- KEYS: lock hash. ARGV: token, ttl ms. Returns 1 when the token still owns the lock (ttl extended), else 0.
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then
  return 0
end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'renewed_at', t[1] .. '.' .. string.format('%06d', tonumber(t[2])), 'ttl_ms', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
