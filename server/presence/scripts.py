"""The Lua scripts behind cluster presence, each one atomic in Redis.

All keys share the ``{presence}`` hash tag (one Redis Cluster slot), so each
script may read and write any of them, and both presence channels carry the
same tag, so on a cluster the script publishes with ``SPUBLISH`` on the shard
that runs it (:func:`for_bus`). Times come from Redis ``TIME``, never
from a node's clock. Hints built here are the msgpack envelopes of
:mod:`protocol.envelope` (``{"v": 1, "k": "hint", "node": id, "users": [...]}``).
"""

from __future__ import annotations

from protocol.envelope import ENVELOPE_VERSION

_PRELUDE = """
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
""".replace("ENVELOPE_VERSION", str(ENVELOPE_VERSION))


def for_bus(script: str, *, sharded: bool) -> str:
    """The script as it must run: ``SPUBLISH`` on a Redis Cluster, ``PUBLISH`` on one Redis.

    A plain ``PUBLISH`` on a cluster is broadcast to every node; ``SPUBLISH``
    stays on the shard of the channel's slot, which is the script's own slot.
    """
    return script.replace("redis.call('PUBLISH'", "redis.call('SPUBLISH'") if sharded else script


REPORT = """
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
"""

REGISTER = (
    _PRELUDE
    + """
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
"""
)

HEARTBEAT = """
-- KEYS: nodes zset, this node's tombstone.  ARGV: node id
-- 0 alive; 1 unknown (Redis lost its data: register again); 2 presumed dead by
-- the writer (presence withdrawn, rows deleted: register again, rewrite rows).
if redis.call('EXISTS', KEYS[2]) == 1 then return 2 end
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 1 end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), ARGV[1])
return 0
"""

DEREGISTER = (
    _PRELUDE
    + """
-- Leave the cluster on a clean shutdown: the writer withdraws these users now.
-- KEYS: nodes zset, this node's hash.  ARGV: node id, hints channel
local users = redis.call('HKEYS', KEYS[2])
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[1], ARGV[1])
publish_hint(ARGV[2], ARGV[1], users)
return #users
"""
)

SWEEP = (
    _PRELUDE
    + """
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
"""
)

ONLINE = """
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
"""

READ_COMMITTED = """
-- The committed state and its seq, read together.  KEYS: seq, committed hash
local seq = redis.call('GET', KEYS[1])
if not seq then return false end
return {seq, redis.call('HGETALL', KEYS[2])}
"""

INIT_COMMITTED = """
-- A Redis without presence state (first start, or it lost its data) starts
-- empty at the seq persisted in wsMeta.  KEYS: seq, committed hash.  ARGV: seq
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""

LEAD = """
-- Acquire or renew the writer lease.  KEYS: leader.  ARGV: token, lease ms
-- 1 renewed, 2 newly acquired, 0 held by another node.
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 2
end
return 0
"""

RELEASE = """
-- KEYS: leader.  ARGV: token
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

COMMIT = """
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
"""
