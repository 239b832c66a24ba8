-- KEYS: lease, epoch, state hash, due zset. ARGV: token, epoch, entry name, state json, next score.
-- Moves an entry on without publishing (a skipped misfire, a new or edited entry); leader only.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return -1 end
redis.call('HSET', KEYS[3], ARGV[3], ARGV[4])
redis.call('ZADD', KEYS[4], ARGV[5], ARGV[3])
return 1
