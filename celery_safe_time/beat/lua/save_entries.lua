-- KEYS: entries hash, version counter, change log zset, then per entry: its audit list, history hash
-- and history slots zset (history.py).
-- ARGV: audit record json without its definitions ("": none), audit size, then per entry: name, definition json.
-- save_entry.lua for many entries in one call (save_entries: one round trip per chunk): each entry is
-- stored, versioned and audited exactly as save_entry.lua stores it. Returns per entry 0 (unchanged)
-- or its new version.
local audit, size = ARGV[1], tonumber(ARGV[2])
local out = {}
for i = 1, (#ARGV - 2) / 2 do
  local name, new = ARGV[1 + 2 * i], ARGV[2 + 2 * i]
  local kept = 3 + 3 * (i - 1)
  local old = redis.call('HGET', KEYS[1], name)
  if old == new then
    out[i] = 0
  else
    local version = redis.call('INCR', KEYS[2])
    redis.call('HSET', KEYS[1], name, new)
    redis.call('ZADD', KEYS[3], version, name)
    if audit ~= '' then
      redis.call('LPUSH', KEYS[kept + 1], string.sub(audit, 1, -2) .. ',"old":' .. (old or 'null') .. ',"new":' .. new .. ',"version":' .. version .. '}')
      redis.call('LTRIM', KEYS[kept + 1], 0, size - 1)
    end
    if not old then
      for k = kept + 1, kept + 3 do redis.call('PERSIST', KEYS[k]) end
    end
    out[i] = version
  end
end
return out
