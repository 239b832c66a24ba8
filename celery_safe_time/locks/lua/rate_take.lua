-- KEYS[1]: the rate key's line, a sorted set scored by time in seconds (Redis TIME): "<token>" for a
--          reservation at the instant it is due, "<token>@<start>" for an admitted call at the place
--          it was given (its reservation's instant, or its start when it did not wait).
-- KEYS[2]: the key's starts, a sorted set: "<token>@<start>" at the real start of each admitted call.
-- ARGV: token, limit, period in microseconds, 1 to reserve a place for a call that does not fit (0:
--       a direct call, which cannot come back, only learns its wait).
-- Returns {1, entries, 0, now} when the call is admitted now, else {0, entries, wait, now}: entries
-- is the line's size, wait the microseconds until the call is due, now the script's time (a string
-- of seconds). The rules: celery_safe_time/locks/rates.py. Each set expires a period after its last
-- entry, so an idle key leaves nothing behind.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local limit = tonumber(ARGV[2])
local period = tonumber(ARGV[3]) / 1000000
local floor = string.format('%.6f', now - period)
local stamp = string.format('%.6f', now)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', floor)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', floor)
local started = redis.call('ZCARD', KEYS[2])

local function wait_until(at)
  return math.max(1, math.ceil((at - now) * 1000000))
end

-- The line lives a period past its last entry (the operator view reads the period back from it).
local function expire_line()
  local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  redis.call('PEXPIRE', KEYS[1], math.ceil((tonumber(last[2]) + period - now) * 1000) + 1)
end

local function admit(place)
  local member = ARGV[1] .. '@' .. stamp
  redis.call('ZADD', KEYS[1], place, member)
  redis.call('ZADD', KEYS[2], stamp, member)
  expire_line()
  redis.call('PEXPIRE', KEYS[2], math.ceil(period * 1000) + 1)
  return {1, redis.call('ZCARD', KEYS[1]), 0, stamp}
end

-- The instant the start that keeps the window of real starts full ages out.
local function starts_free()
  local block = redis.call('ZRANGE', KEYS[2], started - limit, started - limit, 'WITHSCORES')
  return tonumber(block[2]) + period
end

local own = redis.call('ZSCORE', KEYS[1], ARGV[1])
if own then
  if tonumber(own) > now then
    return {0, redis.call('ZCARD', KEYS[1]), wait_until(tonumber(own)), stamp}
  end
  if started < limit then
    redis.call('ZREM', KEYS[1], ARGV[1])
    return admit(own)
  end
  -- Due, but a call ahead started late and the window of real starts is still full: the call keeps
  -- its place, due again when the start that blocks it ages out.
  return {0, redis.call('ZCARD', KEYS[1]), wait_until(starts_free()), stamp}
end
local count = redis.call('ZCARD', KEYS[1])
if count < limit and started < limit then
  return admit(stamp)
end
-- The first instant a place frees after every reservation (the entry limit places from the end of
-- the line ages out), and no sooner than the real starts allow.
local due = now
if count >= limit then
  local frees = redis.call('ZRANGE', KEYS[1], count - limit, count - limit, 'WITHSCORES')
  due = math.max(due, tonumber(frees[2]) + period)
end
if started >= limit then
  due = math.max(due, starts_free())
end
if ARGV[4] ~= '1' then
  return {0, count, wait_until(due), stamp}
end
redis.call('ZADD', KEYS[1], string.format('%.6f', due), ARGV[1])
expire_line()
return {0, count + 1, wait_until(due), stamp}
