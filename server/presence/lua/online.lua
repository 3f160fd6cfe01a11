-- Cluster-wide state of users: visible if any node has them visible.
-- KEYS: nodes zset.  ARGV: key namespace, 'all' or 'some', then users when 'some'
-- Returns user, state pairs ('1' visible, '0' invisible); offline users are absent.
local state, order = {}, {}
local function merge(user, value)
  local known = state[user]
  if known == nil then
    state[user] = value
    order[#order + 1] = user
  elseif value == '1' then
    state[user] = '1'
  end
end
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local key = ARGV[1] .. 'node:' .. id
  if ARGV[2] == 'all' then
    local flat = redis.call('HGETALL', key)
    for i = 1, #flat, 2 do merge(flat[i], flat[i + 1]) end
  else
    for i = 3, #ARGV do
      local value = redis.call('HGET', key, ARGV[i])
      if value then merge(ARGV[i], value) end
    end
  end
end
local out = {}
for _, user in ipairs(order) do
  out[#out + 1] = user
  out[#out + 1] = state[user]
end
return out
