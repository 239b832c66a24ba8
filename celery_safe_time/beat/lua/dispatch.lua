-- KEYS: lease, epoch, fired marker, state hash, due zset.
-- ARGV: token, epoch, marker ttl ms, entry name, state json, next fire score, marker value.
-- Returns 1 (publish), 0 (slot already fired: do not publish), -1 (not the leader).
-- The marker value is new per call ("epoch:nonce"): the same call run again (a client retrying a
-- command whose reply was lost) finds its own marker and still publishes, which a later call does not.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return -1 end
local fresh = redis.call('SET', KEYS[3], ARGV[7], 'NX', 'PX', ARGV[3])
redis.call('HSET', KEYS[4], ARGV[4], ARGV[5])
redis.call('ZADD', KEYS[5], ARGV[6], ARGV[4])
if fresh or redis.call('GET', KEYS[3]) == ARGV[7] then return 1 end
return 0
