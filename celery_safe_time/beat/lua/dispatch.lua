-- KEYS: lease, epoch, fired marker, state hash, due zset.
-- ARGV: token, epoch, marker ttl ms, entry name, state json, next fire score, marker value.
-- Returns 1 (publish), 0 (slot already fired: do not publish), -1 (not the leader).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return -1 end
local fresh = redis.call('SET', KEYS[3], ARGV[7], 'NX', 'PX', ARGV[3])
redis.call('HSET', KEYS[4], ARGV[4], ARGV[5])
redis.call('ZADD', KEYS[5], ARGV[6], ARGV[4])
if fresh then return 1 end
return 0
