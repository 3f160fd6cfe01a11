-- The writer withdraws nodes whose heartbeat is older than the timeout.
-- KEYS: nodes zset, purge set.
-- ARGV: key namespace, timeout ms, tombstone ttl ms, hints channel, caller's node id
local cutoff = now_ms() - tonumber(ARGV[2])
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cutoff)
local swept = {}
for _, id in ipairs(dead) do
  if id ~= ARGV[5] then
    local key = ARGV[1] .. 'node:' .. id
    local users = redis.call('HKEYS', key)
    redis.call('DEL', key)
    redis.call('ZREM', KEYS[1], id)
    redis.call('SET', ARGV[1] .. 'dead:' .. id, '1', 'PX', ARGV[3])
    redis.call('SADD', KEYS[2], id)
    publish_hint(ARGV[4], id, users)
    swept[#swept + 1] = id
  end
end
return swept
