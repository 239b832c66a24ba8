-- Shared by the scripts that write a run record (dispatch.lua, history_record.lua): backends/redis.py puts
-- this file before their own source when it loads them. Writes the run record of slot `slot` (ms) and
-- drops the entry's oldest runs beyond `size`, with their outcomes (history.py).
local function record_history(hash, slots, slot, record, size)
  redis.call('HSET', hash, slot, record)
  redis.call('ZADD', slots, slot, slot)
  local extra = redis.call('ZCARD', slots) - tonumber(size)
  if extra > 0 then
    for _, old in ipairs(redis.call('ZRANGE', slots, 0, extra - 1)) do
      redis.call('HDEL', hash, old, old .. ':o')
    end
    redis.call('ZREMRANGEBYRANK', slots, 0, extra - 1)
  end
end
