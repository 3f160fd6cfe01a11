-- Compare-and-delete: drop a key only while it still holds the caller's value.
-- KEYS: the key.  ARGV: the caller's value (a lease token, a pending claim).
-- 1 deleted; 0 not the caller's (taken over, expired, or done).
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
