-- KEYS: lock hash, idempotency marker[, finished-delivery marker].
-- ARGV: token, window ms, task id, finished marker ttl ms. Returns {recorded, released}.
-- Record an idempotent key's success and drop its in-progress lock in one step. The marker is
-- written even when the lock was lost meanwhile: the body did succeed, and NX keeps the first.
-- A marker holding our own token counts as recorded: a retry after a lost reply to this script.
local t = redis.call('TIME')
local value = cjson.encode({task_id = ARGV[3], token = ARGV[1],
  finished_at = tonumber(t[1]) + tonumber(t[2]) / 1000000})
local recorded = 0
if redis.call('SET', KEYS[2], value, 'PX', ARGV[2], 'NX') then
  recorded = 1
else
  local ok, existing = pcall(cjson.decode, redis.call('GET', KEYS[2]) or '')
  if ok and type(existing) == 'table' and existing.token == ARGV[1] then recorded = 1 end
end
if KEYS[3] then
  redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[4])
end
local released = 0
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  released = redis.call('DEL', KEYS[1])
end
return {recorded, released}
