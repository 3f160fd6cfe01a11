-- Join the cluster with this node's whole user set, replacing any older one.
-- KEYS: nodes zset, this node's hash, its tombstone, purge set
-- ARGV: node id, hints channel, then user, state ('1' visible, '0' invisible) pairs
local old = redis.call('HKEYS', KEYS[2])
redis.call('DEL', KEYS[2])
local seen, users = {}, {}
for _, user in ipairs(old) do
  seen[user] = true
  users[#users + 1] = user
end
for i = 3, #ARGV, 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  if not seen[ARGV[i]] then
    seen[ARGV[i]] = true
    users[#users + 1] = ARGV[i]
  end
end
redis.call('ZADD', KEYS[1], now_ms(), ARGV[1])
redis.call('DEL', KEYS[3])
redis.call('SREM', KEYS[4], ARGV[1])
publish_hint(ARGV[2], ARGV[1], users)
return #users
