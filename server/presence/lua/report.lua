-- A node's users changed: update its hash and hint the writer, in one step.
-- KEYS: this node's hash.  ARGV: hints channel, hint envelope, then user, state
-- pairs (state '1' visible, '0' invisible, '' gone).
for i = 3, #ARGV, 2 do
  if ARGV[i + 1] == '' then
    redis.call('HDEL', KEYS[1], ARGV[i])
  else
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
redis.call('PUBLISH', ARGV[1], ARGV[2])
return 1
