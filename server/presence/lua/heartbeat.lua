-- KEYS: nodes zset, this node's tombstone.  ARGV: node id
-- 0 alive; 1 unknown (Redis lost its data: register again); 2 presumed dead by
-- the writer (presence withdrawn, rows deleted: register again, rewrite rows).
if redis.call('EXISTS', KEYS[2]) == 1 then return 2 end
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 1 end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), ARGV[1])
return 0
