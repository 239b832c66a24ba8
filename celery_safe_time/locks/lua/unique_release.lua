-- KEYS: the unique key (one hash); no other key is read or written. ARGV: task id.
-- Deletes the key only while that task holds it: a later holder's key is never touched.
if redis.call('HGET', KEYS[1], 'task_id') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
