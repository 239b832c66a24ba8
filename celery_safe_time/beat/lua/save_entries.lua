-- KEYS: entries hash, version counter, change log zset, then per entry: its audit list, history hash
-- and history slots zset (history.py); then per shard: its state hash and due zset.
-- ARGV: audit record json without its definitions ("": none), audit size, then per entry: name,
-- definition json, its shard's number ("": no seed), seed due score, seed state json.
-- save_entry.lua for many entries in one call (save_entries: one round trip per chunk): each entry is
-- stored, versioned and audited exactly as save_entry.lua stores it, one after the other (a name that
-- comes twice compares with its earlier definition). Returns per entry 0 (unchanged) or its new version.
-- The chunk's reads and writes of the shared keys are one command each (HMGET, INCRBY, HSET, ZADD),
-- not one per entry: what is left per entry is its audit record and, for a new name, the PERSIST of
-- its kept keys. A changed entry's seed is written as save_entry.lua writes it.
local audit, size = ARGV[1], tonumber(ARGV[2])
local STRIDE = 5
local n = (#ARGV - 2) / STRIDE
local shard_keys = 3 + 3 * n -- the state hash of shard k is KEYS[shard_keys + 2k + 1], its due set the next
local SLICE = 1000 -- values per variadic call: Lua's unpack has a stack limit

local names = {}
for i = 1, n do names[i] = ARGV[3 + STRIDE * (i - 1)] end
local stored = {} -- false where the name has no definition (HMGET's nil)
for first = 1, n, SLICE do
  local got = redis.call('HMGET', KEYS[1], unpack(names, first, math.min(first + SLICE - 1, n)))
  for j = 1, #got do stored[first + j - 1] = got[j] end
end

-- which entries change and what each replaces, in order (a later duplicate sees the earlier one)
local current, changes, count = {}, {}, 0
for i = 1, n do
  local name, new = names[i], ARGV[4 + STRIDE * (i - 1)]
  local old = current[name]
  if old == nil then old = stored[i] end
  if old ~= new then
    count = count + 1
    changes[i] = old
    current[name] = new
  end
end

local out = {}
if count == 0 then
  for i = 1, n do out[i] = 0 end
  return out
end
local version = redis.call('INCRBY', KEYS[2], count) - count
local fields, scores = {}, {}
for i = 1, n do
  local old = changes[i]
  if old == nil then
    out[i] = 0
  else
    version = version + 1
    out[i] = version
    local at = 3 + STRIDE * (i - 1)
    local name, new = names[i], ARGV[at + 1]
    fields[#fields + 1] = name
    fields[#fields + 1] = new
    scores[#scores + 1] = version
    scores[#scores + 1] = name
    local kept = 3 + 3 * (i - 1)
    if audit ~= '' then
      local length = redis.call('LPUSH', KEYS[kept + 1], string.sub(audit, 1, -2) .. ',"old":' .. (old or 'null') .. ',"new":' .. new .. ',"version":' .. version .. '}')
      if length > size then redis.call('LTRIM', KEYS[kept + 1], 0, size - 1) end
    end
    if not old then
      for k = kept + 1, kept + 3 do redis.call('PERSIST', KEYS[k]) end
    end
    if ARGV[at + 2] ~= '' then
      local state_key = KEYS[shard_keys + 2 * tonumber(ARGV[at + 2]) + 1]
      local state = redis.call('HGET', state_key, name)
      if not state or string.sub(state, 1, 15) == '{"last": null, ' then
        redis.call('HSET', state_key, name, ARGV[at + 4])
        redis.call('ZADD', KEYS[shard_keys + 2 * tonumber(ARGV[at + 2]) + 2], ARGV[at + 3], name)
      end
    end
  end
end
-- a name twice: the later value and version win, as they would one command at a time
for first = 1, #fields, 2 * SLICE do
  redis.call('HSET', KEYS[1], unpack(fields, first, math.min(first + 2 * SLICE - 1, #fields)))
  redis.call('ZADD', KEYS[3], unpack(scores, first, math.min(first + 2 * SLICE - 1, #scores)))
end
return out
