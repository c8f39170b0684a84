-- KEYS: the replicas sorted set, the store's epoch marker. ARGV: this replica's id, how long a
-- replica counts as alive after its last beat (s), the epoch to set when there is none.
-- Reply: {replicas alive, the epoch before this call ('' when the marker was missing)}.
-- A marker that vanished means the store lost its data (a restart without persistence, a
-- flush): every count and hold it had is gone.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) * 2))
local epoch = redis.call('GET', KEYS[2])
if not epoch then
  redis.call('SET', KEYS[2], ARGV[3])
  epoch = ''
end
return {redis.call('ZCARD', KEYS[1]), epoch}
