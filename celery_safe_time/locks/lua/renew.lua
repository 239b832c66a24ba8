-- KEYS: lock hash, fence counter. ARGV: token, ttl ms. Returns 1 when the token still owns the lock
-- (ttl extended), else 0.
-- The counter lives at least as long as the lock: one expired under a held lock would be seeded
-- again at the next acquire, so the next holder's fence would jump instead of being the next one.
-- It is only ever lengthened: a counter that outlives this lock keeps its longer ttl (PEXPIRE's GT
-- option needs Redis 7; 6.2 is supported).
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then
  return 0
end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'renewed_at', t[1] .. '.' .. string.format('%06d', tonumber(t[2])), 'ttl_ms', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local left = redis.call('PTTL', KEYS[2])
if left >= 0 and left < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return 1
