-- Functions shared by the presence scripts that need them (register, deregister,
-- sweep), prepended to each. A hint is a bus envelope: the placeholder for its
-- version in publish_hint is replaced, when the scripts are loaded, by the one
-- constant in protocol/envelope.py.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function publish_hint(channel, node, users)
  if #users > 0 then
    redis.call('PUBLISH', channel,
      cmsgpack.pack({v = ENVELOPE_VERSION, k = 'hint', node = node, users = users}))
  end
end
