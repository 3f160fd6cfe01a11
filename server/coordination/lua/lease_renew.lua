-- Take a lease if nobody holds it, or renew it if the caller does.
-- KEYS: the lease.  ARGV: the caller's token, lease ms.
-- 1 renewed, 2 newly acquired, 0 held by another.
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 2
end
return 0
