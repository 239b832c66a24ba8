-- KEYS: the rate key's sliding log (a sorted set: call token -> start time in seconds, Redis TIME).
-- ARGV: token, limit, period in microseconds.
-- Returns {1, count, 0} when the call is admitted (its start time added), else {0, count, wait}: the
-- microseconds until enough entries are a period old for a place to free. The set expires a period
-- after its newest entry, so an idle key leaves nothing behind.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local limit = tonumber(ARGV[2])
local period = tonumber(ARGV[3]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.6f', now - period))
local count = redis.call('ZCARD', KEYS[1])
if count < limit then
  redis.call('ZADD', KEYS[1], string.format('%.6f', now), ARGV[1])
  redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3]) / 1000))
  return {1, count + 1, 0}
end
-- More live entries than the limit (a dynamic limit lowered since): wait for the one whose expiry
-- leaves limit - 1 behind.
local frees = redis.call('ZRANGE', KEYS[1], count - limit, count - limit, 'WITHSCORES')
local wait = math.ceil((tonumber(frees[2]) + period - now) * 1000000)
if wait < 0 then wait = 0 end
return {0, count, wait}
