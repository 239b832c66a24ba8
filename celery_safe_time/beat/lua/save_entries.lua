-- KEYS: entries hash, version counter, change log zset, then per entry: its audit list, history hash
-- and history slots zset (history.py); then per shard: its state hash and due zset.
-- ARGV: audit record json without its definitions ("": none), audit size, the number of entries n,
-- then per entry: name, definition json, its seed ("": none; "k" or, sharded, "k:shard": the k-th seed
-- of the seed table, 0-based, in that shard), then the seed table: per seed its state json, due score.
-- save_entry.lua for many entries in one call (save_entries: one round trip per chunk): each entry is
-- stored, versioned and audited exactly as save_entry.lua stores it, one after the other (a name that
-- comes twice compares with its earlier definition). Returns per entry 0 (unchanged) or its new version.
-- The chunk's reads and writes of the shared keys are one command each (HMGET, INCRBY, HSET, ZADD),
-- not one per entry: what is left per entry is its audit record and, for a new name, the PERSIST of
-- its kept keys. A changed entry's seed is written as save_entry.lua writes it, a command per shard
-- (HMGET of the states, HSET, ZADD) for the chunk. Entries planned alike share one seed of the table.
local audit, size, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local STRIDE = 3
local FIRST = 4 -- ARGV index of the first entry's name
local seed_table = FIRST + STRIDE * n -- seed k's state is ARGV[seed_table + 2k], its due score the next
local shard_keys = 3 + 3 * n -- the state hash of shard s is KEYS[shard_keys + 2s + 1], its due set the next
local SLICE = 1000 -- values per variadic call: Lua's unpack has a stack limit

local names = {}
for i = 1, n do names[i] = ARGV[FIRST + STRIDE * (i - 1)] end
local stored = {} -- false where the name has no definition (HMGET's nil)
for first = 1, n, SLICE do
  local got = redis.call('HMGET', KEYS[1], unpack(names, first, math.min(first + SLICE - 1, n)))
  for j = 1, #got do stored[first + j - 1] = got[j] end
end

-- which entries change and what each replaces, in order (a later duplicate sees the earlier one)
local current, changes, count = {}, {}, 0
for i = 1, n do
  local name, new = names[i], ARGV[FIRST + 1 + STRIDE * (i - 1)]
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
    local name, new = names[i], ARGV[FIRST + 1 + STRIDE * (i - 1)]
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
  end
end
-- a name twice: the later value and version win, as they would one command at a time
for first = 1, #fields, 2 * SLICE do
  redis.call('HSET', KEYS[1], unpack(fields, first, math.min(first + 2 * SLICE - 1, #fields)))
  redis.call('ZADD', KEYS[3], unpack(scores, first, math.min(first + 2 * SLICE - 1, #scores)))
end

-- the seeds of the changed entries, by shard: written where the entry has no state or one that never fired
local by_shard = {}
for i = 1, n do
  local ref = ARGV[FIRST + 2 + STRIDE * (i - 1)]
  if changes[i] ~= nil and ref ~= '' then
    local seed, shard = ref, 0
    local colon = string.find(ref, ':', 1, true)
    if colon then
      seed, shard = string.sub(ref, 1, colon - 1), tonumber(string.sub(ref, colon + 1))
    end
    local group = by_shard[shard]
    if not group then
      group = {names = {}, seeds = {}}
      by_shard[shard] = group
    end
    group.names[#group.names + 1] = names[i]
    group.seeds[#group.seeds + 1] = tonumber(seed)
  end
end
for shard, group in pairs(by_shard) do
  local state_key, due_key = KEYS[shard_keys + 2 * shard + 1], KEYS[shard_keys + 2 * shard + 2]
  local states, dues = {}, {}
  local count = #group.names
  for first = 1, count, SLICE do
    local got = redis.call('HMGET', state_key, unpack(group.names, first, math.min(first + SLICE - 1, count)))
    for j = 1, #got do
      if not got[j] or string.sub(got[j], 1, 15) == '{"last": null, ' then
        local name, at = group.names[first + j - 1], seed_table + 2 * group.seeds[first + j - 1]
        states[#states + 1] = name
        states[#states + 1] = ARGV[at]
        dues[#dues + 1] = ARGV[at + 1]
        dues[#dues + 1] = name
      end
    end
  end
  -- a name twice: the later seed wins, as one save after the other
  for first = 1, #states, 2 * SLICE do
    redis.call('HSET', state_key, unpack(states, first, math.min(first + 2 * SLICE - 1, #states)))
    redis.call('ZADD', due_key, unpack(dues, first, math.min(first + 2 * SLICE - 1, #dues)))
  end
end

return out
