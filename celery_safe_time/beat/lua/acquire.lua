-- KEYS: lease, epoch, leader info. ARGV: token, lease ms, info json (epoch filled in here).
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
  return tonumber(redis.call('GET', KEYS[2]) or '0')
end
if holder then return -1 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local epoch = redis.call('INCR', KEYS[2])
local info = cjson.decode(ARGV[3])
info['epoch'] = epoch
redis.call('SET', KEYS[3], cjson.encode(info), 'PX', ARGV[2])
return epoch
