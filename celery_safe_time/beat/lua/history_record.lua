-- KEYS: history hash, history slots zset. ARGV: slot ms, record json, history size.
-- A run record written outside a dispatch (a backfill's slot): as dispatch.lua writes it, the
-- entry's oldest runs beyond the history size dropped.
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1])
local extra = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
if extra > 0 then
  for _, old in ipairs(redis.call('ZRANGE', KEYS[2], 0, extra - 1)) do
    redis.call('HDEL', KEYS[1], old, old .. ':o')
  end
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, extra - 1)
end
return 1
