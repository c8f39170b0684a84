-- Place one session on a member of a pool (gateway/upstream/placement.py, SharedPlacement).
-- KEYS[1]: the session's key (its member's name); KEYS[1+i]: candidate i's sorted set of sessions,
-- scored by last use (server time, ms).
-- ARGV[1]: how long a session counts after its last use (ms); ARGV[2]: the session's id;
-- ARGV[3i], ARGV[3i+1], ARGV[3i+2]: candidate i's name, '1' if it may take the session now ('0': over
-- the load bound), and its rank (0: the best placed), candidates in the caller's order of preference.
-- A session stays where it is while its member may take it; else it goes to the lowest rank,
-- then the fewest live sessions, then the first in order.
-- Reply: {member, 1 if the session moved there from another member else 0}, or false (no candidate may).
-- A call costs O(candidates x log sessions): live sessions are counted by score (ZCOUNT), and at most
-- EXPIRE_PER_CALL expired ones are removed per candidate, so sessions that expire together (a client
-- minting one per request) are cleared over the next calls instead of in one command that blocks
-- the store for every replica (200,000 at once took 65 ms). Each first turn adds one session and
-- removes up to that many: the sets never grow past their live sessions plus a backlog that shrinks.
local EXPIRE_PER_CALL = 64
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl, sid = tonumber(ARGV[1]), ARGV[2]
local n = #KEYS - 1
local cur = redis.call('GET', KEYS[1])
local pick, moved = nil, 0
if cur then
  for i = 1, n do
    if ARGV[3 * i] == cur and ARGV[3 * i + 1] == '1' then pick = i end
  end
end
if not pick then
  local best_level, fewest = nil, nil
  for i = 1, n do
    if ARGV[3 * i + 1] == '1' then
      local old = redis.call('ZRANGEBYSCORE', KEYS[1 + i], '-inf', now - ttl, 'LIMIT', 0, EXPIRE_PER_CALL)
      if #old > 0 then redis.call('ZREM', KEYS[1 + i], unpack(old)) end
      local level = tonumber(ARGV[3 * i + 2])
      local count = redis.call('ZCOUNT', KEYS[1 + i], '(' .. (now - ttl), '+inf')
      if best_level == nil or level < best_level or (level == best_level and count < fewest) then
        best_level, fewest, pick = level, count, i
      end
    end
  end
  if not pick then return false end
  if cur then
    moved = 1
    for i = 1, n do
      if ARGV[3 * i] == cur then redis.call('ZREM', KEYS[1 + i], sid) end
    end
  end
end
redis.call('SET', KEYS[1], ARGV[3 * pick], 'PX', ttl)
redis.call('ZADD', KEYS[1 + pick], now, sid)
redis.call('PEXPIRE', KEYS[1 + pick], ttl)
return {ARGV[3 * pick], moved}
