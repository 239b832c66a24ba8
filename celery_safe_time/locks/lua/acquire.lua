-- KEYS: lock hash, fence counter[, idempotency marker].
-- ARGV: token, ttl ms, task id, host, pid, identity (task id:retries:requeues).
-- Returns {"done"} (marker set), {"held"|"duplicate", holder task id, host, pid, fence}, or {"acquired", fence}.
if KEYS[3] and redis.call('EXISTS', KEYS[3]) == 1 then
  return {'done'}
end
local cur = redis.call('HMGET', KEYS[1], 'token', 'identity', 'task_id', 'host', 'pid', 'fence')
if cur[1] then
  local status = 'held'
  if cur[2] == ARGV[6] then status = 'duplicate' end
  return {status, cur[3], cur[4], cur[5], cur[6]}
end
local fence = redis.call('INCR', KEYS[2])
local t = redis.call('TIME')
local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'task_id', ARGV[3], 'host', ARGV[4], 'pid', ARGV[5],
  'identity', ARGV[6], 'fence', fence, 'acquired_at', now, 'renewed_at', now, 'ttl_ms', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {'acquired', fence}
