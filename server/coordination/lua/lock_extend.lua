-- Extend a lock only while the caller still holds it.
-- KEYS: the lock.  ARGV: holder's token, lease ms.  1 extended; 0 not held.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
