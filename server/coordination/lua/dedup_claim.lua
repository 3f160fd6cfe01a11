-- Claim a delivery for publishing, unless it is done or another consumer has it.
-- KEYS: the key.  ARGV: pending value, pending ttl ms.
-- 1 claimed (or already ours: extended), 0 done, -1 claimed by another.
local value = redis.call('GET', KEYS[1])
if not value or value == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if value == 'd' then return 0 end
return -1
