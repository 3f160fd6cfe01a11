-- Count one action if the user is under the limit in the sliding window.
-- KEYS: the user's log (a zset of accepted times).  ARGV: window ms, limit, member.
-- 1 allowed (logged); 0 over the limit (not logged). Times come from Redis, so
-- nodes with skewed clocks share one window.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], now, ARGV[3])
redis.call('PEXPIRE', KEYS[1], window)
return 1
