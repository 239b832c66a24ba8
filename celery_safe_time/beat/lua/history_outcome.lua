-- KEYS: history hash. ARGV: slot ms, outcome json.
-- The worker's outcome of one run: written only beside its run record (a run already trimmed away,
-- or published with the history off, leaves nothing behind). 1 when written, else 0.
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1] .. ':o', ARGV[2])
return 1
