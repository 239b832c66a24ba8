-- KEYS: fired markers (one entry's slots). ARGV: marker ttl ms, marker value.
-- A backfill's claim: marks each slot fired unless it is, without the lease (a backfill publishes
-- past slots beside the leader, and the marker is what keeps the two from publishing one slot twice).
-- Returns per key 1 (this call marked it: publish) or 0 (already fired). The value is new per call:
-- the same call run again (a reply lost) finds its own markers and still answers 1, as in dispatch.lua.
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('SET', key, ARGV[2], 'NX', 'PX', ARGV[1]) or redis.call('GET', key) == ARGV[2] then
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
