-- Commit one delta and publish it, in one step, only if it is exactly right:
-- a later seq, and per user the change from the state Redis holds (so a writer
-- whose copy drifted from Redis cannot publish a wrong delta).
-- KEYS: leader, seq, committed hash
-- ARGV: token, seq, total after, deltas channel, envelope, then per user:
--       user, new state ('1' visible, '0' invisible, '' offline), '1' if a leave
-- 1 committed; 0 fenced (not the lease holder); -1 stale (the writer's copy of
-- the committed state is not Redis's: it must reload).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local current = tonumber(redis.call('GET', KEYS[2]))
if current == nil or tonumber(ARGV[2]) <= current then return -1 end
local size = redis.call('HLEN', KEYS[3])
for i = 6, #ARGV, 3 do
  local old = redis.call('HGET', KEYS[3], ARGV[i]) or ''
  local new = ARGV[i + 1]
  if old == new then return -1 end
  if (old == '1' and new ~= '1') ~= (ARGV[i + 2] == '1') then return -1 end
  if old == '' then size = size + 1 end
  if new == '' then size = size - 1 end
end
if size ~= tonumber(ARGV[3]) then return -1 end
for i = 6, #ARGV, 3 do
  if ARGV[i + 1] == '' then
    redis.call('HDEL', KEYS[3], ARGV[i])
  else
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
  end
end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
