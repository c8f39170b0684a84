-- ARGV: request key, tokens a stream produced, their USD, hold ttl (s), then the limits per scope
-- as for admit. Reply: {'ok'} or {kind, scope index, retry after (s)} once a scope is past a limit.
local rid, tokens, usd, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local rec = redis.call('HGET', KEYS[1], rid)
local freed = 0
if rec then
  local parts = split(rec)
  local remaining = tonumber(parts[1])
  local left = math.max(0, remaining - usd)
  freed = remaining - left
  redis.call('HSET', KEYS[1], rid, record(left, tonumber(parts[2]) + tokens, tonumber(parts[3]) + usd))
  redis.call('ZADD', KEYS[2], NOW + ttl, rid)
end
for i = 1, NSCOPES do
  add(KEYS[3 * i + 1], tokens)
  add_spend(KEYS[3 * i + 2], usd)
  unhold(KEYS[3 * i + 2], freed)
end
for i = 1, NSCOPES do
  local tpm, daily, monthly = tonumber(ARGV[4 * i + 2]), tonumber(ARGV[4 * i + 3]), tonumber(ARGV[4 * i + 4])
  if tpm then
    local used, buckets = window(KEYS[3 * i + 1])
    if used > tpm then return {'tpm', i, fmt(retry(buckets, used - tpm))} end
  end
  local d, m = spend(KEYS[3 * i + 2])
  if daily and d > daily then return {'day', i, fmt(UNTIL_DAY)} end
  if monthly and m > monthly then return {'month', i, fmt(UNTIL_MONTH)} end
end
return {'ok'}
