-- KEYS: the rate key's sliding log, a sorted set of members scored by time in seconds (Redis TIME):
--       "<token>@<start>" for an admitted call, "<token>" for a reservation (a call due later).
-- ARGV: token, limit, period in microseconds, 1 to reserve a place for a call that does not fit (0:
--       a direct call, which cannot come back, only learns its wait).
-- Returns {1, entries, 0, now} when the call is admitted now, else {0, entries, wait, now}: wait is
-- the microseconds until its reservation is due, now the script's time (a string of seconds) (the rules: celery_safe_time/locks/rates.py). The set expires a period
-- after its last entry, so an idle key leaves nothing behind.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local limit = tonumber(ARGV[2])
local period = tonumber(ARGV[3]) / 1000000
local floor = string.format('%.6f', now - period)
local stamp = string.format('%.6f', now)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', floor)

-- The set lives a period past its last entry (the operator view reads the period back from it).
local function expire()
  local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  redis.call('PEXPIRE', KEYS[1], math.ceil((tonumber(last[2]) + period - now) * 1000) + 1)
end

local function admit()
  redis.call('ZADD', KEYS[1], stamp, ARGV[1] .. '@' .. stamp)
  expire()
  return {1, redis.call('ZCARD', KEYS[1]), 0, stamp}
end

local own = redis.call('ZSCORE', KEYS[1], ARGV[1])
if own then
  own = tonumber(own)
  if own > now then
    return {0, redis.call('ZCARD', KEYS[1]), math.ceil((own - now) * 1000000), stamp}
  end
  redis.call('ZREM', KEYS[1], ARGV[1])
  -- Due: admitted if fewer than limit calls started within the period before now.
  local started = redis.call('ZCOUNT', KEYS[1], '(' .. floor, stamp)
  if started < limit then
    return admit()
  end
  -- A call ahead started late and the window is still full: keep the place in line, due again when
  -- the start that blocks it ages out.
  local block = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. floor, stamp, 'WITHSCORES', 'LIMIT', started - limit, 1)
  local again = tonumber(block[2]) + period
  redis.call('ZADD', KEYS[1], string.format('%.6f', again), ARGV[1])
  expire()
  return {0, redis.call('ZCARD', KEYS[1]), math.ceil((again - now) * 1000000), stamp}
end
local count = redis.call('ZCARD', KEYS[1])
if count < limit then
  return admit()
end
-- The first instant a place frees after every reservation: the entry limit places from the end ages out.
local frees = redis.call('ZRANGE', KEYS[1], count - limit, count - limit, 'WITHSCORES')
local due = tonumber(frees[2]) + period
if ARGV[4] ~= '1' then
  return {0, count, math.ceil((due - now) * 1000000), stamp}
end
redis.call('ZADD', KEYS[1], string.format('%.6f', due), ARGV[1])
expire()
return {0, count + 1, math.ceil((due - now) * 1000000), stamp}
