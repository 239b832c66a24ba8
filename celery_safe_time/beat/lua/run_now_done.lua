-- KEYS: run-now hash. ARGV: entry name, the slot (ms) the leader handled.
-- Clears a run-now request unless a newer one replaced it meanwhile (that one runs next tick).
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return 1
end
return 0
