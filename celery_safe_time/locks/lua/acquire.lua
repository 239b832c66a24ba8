-- KEYS: lock hash, fence counter, finished-delivery marker[, idempotency marker].
-- ARGV: token, ttl ms, task id, host, pid, identity (one delivery of one message), then the tokens
--       earlier attempts of this delivery sent without learning the outcome (lost replies).
-- Returns {"done"} (idempotency marker set), {"finished"} (this delivery already ran to its end),
-- {"held"|"duplicate", holder task id, host, pid, fence}, or {"acquired", fence, "new"|"own"}.
-- One EXISTS for both markers (each redis.call costs the script a few microseconds); which one is
-- set is only asked when one is.
local markers
if KEYS[4] then markers = redis.call('EXISTS', KEYS[3], KEYS[4]) else markers = redis.call('EXISTS', KEYS[3]) end
if markers > 0 then
  if KEYS[4] and redis.call('EXISTS', KEYS[4]) == 1 then
    return {'done'}
  end
  return {'finished'}
end
local t = redis.call('TIME')
local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
local cur = redis.call('HMGET', KEYS[1], 'token', 'identity', 'task_id', 'host', 'pid', 'fence')
if cur[1] then
  -- Our own token: this call is redis-py retrying after a lost reply, or an earlier attempt of
  -- this delivery set the lock and never heard back. Nobody ran under it: take it over, same fence.
  local own = cur[1] == ARGV[1]
  for i = 7, #ARGV do
    if cur[1] == ARGV[i] then own = true end
  end
  if own then
    redis.call('HSET', KEYS[1], 'token', ARGV[1], 'task_id', ARGV[3], 'host', ARGV[4], 'pid', ARGV[5],
      'identity', ARGV[6], 'renewed_at', now, 'ttl_ms', ARGV[2])
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    -- The counter lives at least as long as the lock, as renew.lua keeps it.
    local left = redis.call('PTTL', KEYS[2])
    if left >= 0 and left < tonumber(ARGV[2]) then
      redis.call('PEXPIRE', KEYS[2], ARGV[2])
    end
    return {'acquired', cur[6], 'own'}
  end
  local status = 'held'
  if cur[2] == ARGV[6] then status = 'duplicate' end
  return {status, cur[3], cur[4], cur[5], cur[6]}
end
-- A missing counter (new key, expired, or a Redis that lost its data) starts at Redis TIME in
-- microseconds, above every fence handed out before (those are at most one per microsecond past their
-- own seed). INCR makes a missing counter 1, and a seeded one is never 1: that is the test, one call
-- when seeded. The counter expires with the lock's ttl (renew.lua extends both), so a key nobody
-- locks again leaves nothing behind; the seed keeps the fence increasing across that expiry.
local fence = redis.call('INCR', KEYS[2])
if fence == 1 then
  redis.call('SET', KEYS[2], t[1] .. string.format('%06d', tonumber(t[2])))
  fence = redis.call('INCR', KEYS[2])
end
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'task_id', ARGV[3], 'host', ARGV[4], 'pid', ARGV[5],
  'identity', ARGV[6], 'fence', fence, 'acquired_at', now, 'renewed_at', now, 'ttl_ms', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {'acquired', fence, 'new'}
