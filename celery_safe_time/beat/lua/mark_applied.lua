-- KEYS: lease, applied marker. ARGV: token, marker value ("<version> <planning fingerprint>").
-- Records which change counter the state and due set reflect; only the lease holder may say so.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
return 1
