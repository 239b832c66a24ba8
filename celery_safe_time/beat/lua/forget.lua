-- KEYS: lease, epoch, state hash, due zset. ARGV: token, epoch, entry name, keep state ('1' or '0').
-- Takes an entry out of the due set (paused, deleted, broken); leader only. A paused entry keeps
-- its state (last and next slot) so that resuming continues its grid.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return -1 end
redis.call('ZREM', KEYS[4], ARGV[3])
if ARGV[4] ~= '1' then redis.call('HDEL', KEYS[3], ARGV[3]) end
return 1
