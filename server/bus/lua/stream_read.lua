-- A stream's position and the history after an offset, read in one step so they agree.
-- KEYS: meta, history.  ARGV: after, most entries, epoch to create if none, meta ttl ms.
-- Returns {epoch, top offset, entries}; a missing stream starts a new epoch at 0.
local epoch = redis.call('HGET', KEYS[1], 'e')
if not epoch then
  epoch = ARGV[3]
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[1], 'e', epoch, 's', 0)
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return {epoch, 0, {}}
end
local top = tonumber(redis.call('HGET', KEYS[1], 's'))
local after = tonumber(ARGV[1])
local entries = {}
if after < top then
  entries = redis.call('XRANGE', KEYS[2], (after + 1) .. '-0', '+', 'COUNT', ARGV[2])
end
return {epoch, top, entries}
