-- Assign the next position of a stream, keep the event in its history, publish it.
-- KEYS: meta, history, the event id's key, and a fence (a lease in the stream's slot) or none.
-- ARGV: envelope, history size, history ttl ms, meta ttl ms, epoch to use if the
-- stream has none, the event id's window ms, the fence's token ('' without one),
-- '1' to release the fence after the append, then the channels to publish on.
-- Returns {epoch, offset, 1 if the event id was a repeat else 0, 0 if the fence
-- was not held by the token else 1}.
local held = 1
if KEYS[4] and redis.call('GET', KEYS[4]) ~= ARGV[7] then
  held = 0
end
local function released()
  if held == 1 and ARGV[8] == '1' then
    redis.call('DEL', KEYS[4])
  end
  return held
end
if KEYS[3] then
  local seen = redis.call('GET', KEYS[3])
  if seen then
    local colon = string.find(seen, ':', 1, true)
    return {string.sub(seen, 1, colon - 1), tonumber(string.sub(seen, colon + 1)), 1, released()}
  end
end
local epoch = redis.call('HGET', KEYS[1], 'e')
if not epoch then
  epoch = ARGV[5]
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[1], 'e', epoch, 's', 0)
end
local offset = redis.call('HINCRBY', KEYS[1], 's', 1)
redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[2], offset .. '-0', 'd', ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if KEYS[3] then
  redis.call('SET', KEYS[3], epoch .. ':' .. offset, 'PX', ARGV[6])
end
local message = '\0' .. epoch .. '\0' .. offset .. '\0' .. ARGV[1]
for i = 9, #ARGV do
  redis.call('PUBLISH', ARGV[i], message)
end
return {epoch, offset, 0, released()}
