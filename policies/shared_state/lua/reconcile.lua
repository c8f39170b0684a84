-- Run before settle.lua, as one script: a request one replica admitted while the store was
-- unreachable (state.on_outage: local_share or allow), now counted here. ARGV as settle's: the
-- request key, its final tokens and USD. An admission that reached the store late (it timed out
-- at the replica, and the store ran it after a pause) left its hold record: settle.lua replaces it
-- by the final count. One that never reached the store is counted now, then settled like the rest.
-- A marker (swept like a hold, an hour later) makes a call sent again a no-op: each request is
-- counted once whatever happened to the calls.
local marker = 'done:' .. ARGV[1]
if redis.call('HEXISTS', KEYS[1], marker) == 1 then return {'ok'} end
redis.call('HSET', KEYS[1], marker, '0\t0\t0')
redis.call('ZADD', KEYS[2], NOW + 3600, marker)
if not redis.call('HGET', KEYS[1], ARGV[1]) then
  for i = 1, NSCOPES do add(KEYS[3 * i], 1) end
end
