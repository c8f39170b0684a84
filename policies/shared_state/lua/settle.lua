-- ARGV: request key, its final tokens and USD. What the request held is released and what its
-- stream was charged is replaced by the final count; a hold already swept counts as nothing charged.
local rid, tokens, usd = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local rec = redis.call('HGET', KEYS[1], rid)
local remaining, charged_tokens, charged_usd = 0, 0, 0
if rec then
  local parts = split(rec)
  remaining, charged_tokens, charged_usd = tonumber(parts[1]), tonumber(parts[2]), tonumber(parts[3])
  redis.call('HDEL', KEYS[1], rid)
end
redis.call('ZREM', KEYS[2], rid)
for i = 1, NSCOPES do
  add(KEYS[3 * i + 1], tokens - charged_tokens)
  add_spend(KEYS[3 * i + 2], usd - charged_usd)
  unhold(KEYS[3 * i + 2], remaining)
end
return {'ok'}
