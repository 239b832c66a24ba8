-- KEYS: the unique key (one hash, <prefix>unique:<key>); no other key is read or written.
-- ARGV: task id, ttl ms, state, stored ("1": the holder is a stored delay, "0": a broker message,
--       "": keep what the hash says), host, gone holder (a task id the caller found gone, or ""),
--       own ("1": the caller is that task itself: its retry, or its run starting).
-- Returns {"acquired"}, {"own"} (already ours: state and ttl refreshed) or
-- {"held", holder task id, state, stored, ms left}.
local cur = redis.call('HMGET', KEYS[1], 'task_id', 'state', 'stored')
local t = redis.call('TIME')
local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
if cur[1] then
  if cur[1] == ARGV[1] and ARGV[7] == '1' then
    redis.call('HSET', KEYS[1], 'state', ARGV[3], 'host', ARGV[5], 'updated_at', now, 'ttl_ms', ARGV[2])
    if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'stored', ARGV[4]) end
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {'own'}
  end
  if ARGV[6] == '' or cur[1] ~= ARGV[6] then
    return {'held', cur[1], cur[2] or '', cur[3] or '0', redis.call('PTTL', KEYS[1])}
  end
end
local stored = ARGV[4]
if stored == '' then stored = '0' end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'task_id', ARGV[1], 'state', ARGV[3], 'stored', stored, 'host', ARGV[5],
  'created_at', now, 'updated_at', now, 'ttl_ms', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {'acquired'}
