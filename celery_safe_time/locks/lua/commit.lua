-- KEYS: lock hash, idempotency marker. ARGV: token, window ms, task id. Returns {recorded, released}.
-- Record an idempotent key's success and drop its in-progress lock in one step. The marker is
-- written even when the lock was lost meanwhile: the body did succeed, and NX keeps the first.
local t = redis.call('TIME')
local value = cjson.encode({task_id = ARGV[3], finished_at = tonumber(t[1]) + tonumber(t[2]) / 1000000})
local recorded = redis.call('SET', KEYS[2], value, 'PX', ARGV[2], 'NX')
local released = 0
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  released = redis.call('DEL', KEYS[1])
end
if recorded then return {1, released} end
return {0, released}
