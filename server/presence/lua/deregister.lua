-- Leave the cluster on a clean shutdown: the writer withdraws these users now.
-- KEYS: nodes zset, this node's hash.  ARGV: node id, hints channel
local users = redis.call('HKEYS', KEYS[2])
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[1], ARGV[1])
publish_hint(ARGV[2], ARGV[1], users)
return #users
