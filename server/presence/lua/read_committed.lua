-- The committed state and its seq, read together.  KEYS: seq, committed hash
local seq = redis.call('GET', KEYS[1])
if not seq then return false end
return {seq, redis.call('HGETALL', KEYS[2])}
