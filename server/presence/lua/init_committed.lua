-- A Redis without presence state (first start, or it lost its data) starts
-- empty at the seq persisted in wsMeta.  KEYS: seq, committed hash.  ARGV: seq
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1])
return 1
