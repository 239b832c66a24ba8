-- KEYS: lease, epoch, fired marker. ARGV: token, epoch, marker ttl ms, marker value.
-- The dispatch check without Redis-side state, for schedulers that keep state elsewhere (the database).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return -1 end
-- The marker value is new per call: a retried call (its reply lost) finds its own marker, as in dispatch.lua.
if redis.call('SET', KEYS[3], ARGV[4], 'NX', 'PX', ARGV[3]) then return 1 end
if redis.call('GET', KEYS[3]) == ARGV[4] then return 1 end
return 0
