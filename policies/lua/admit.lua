-- ARGV: request key, estimated tokens, USD to hold, hold ttl (s), then per scope:
-- requests/min, tokens/min, daily USD, monthly USD ('' = unlimited).
-- Reply: {'ok'} or {kind, scope index, retry after (s), '1' when holds made the difference}.
local rid, tokens, reserve, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
for i = 1, NSCOPES do
  local req, tok, skey = KEYS[3 * i], KEYS[3 * i + 1], KEYS[3 * i + 2]
  local rpm, tpm = tonumber(ARGV[4 * i + 1]), tonumber(ARGV[4 * i + 2])
  local daily, monthly = tonumber(ARGV[4 * i + 3]), tonumber(ARGV[4 * i + 4])
  if rpm then
    local seen, buckets = window(req)
    if seen + 1 > rpm then return {'rpm', i, fmt(retry(buckets, seen + 1 - rpm))} end
  end
  if tpm then
    local used, buckets = window(tok)
    if used + tokens > tpm then
      if tokens > tpm then return {'tpm_big', i, fmt(WINDOW)} end
      return {'tpm', i, fmt(retry(buckets, used + tokens - tpm))}
    end
  end
  local d, m, held = spend(skey)
  if daily and d + held >= daily then
    return {'day', i, fmt(d >= daily and UNTIL_DAY or 1), held > 0 and '1' or '0'}
  end
  if monthly and m + held >= monthly then return {'month', i, fmt(UNTIL_MONTH)} end
end
local stale = redis.call('HGET', KEYS[1], rid)
if stale then  -- a key used twice: release the first hold rather than leak it
  local parts = split(stale)
  for j = 4, #parts do unhold(parts[j], tonumber(parts[1])) end
end
for i = 1, NSCOPES do
  add(KEYS[3 * i], 1)
  add(KEYS[3 * i + 1], tokens)
  if reserve > 0 then redis.call('HINCRBYFLOAT', KEYS[3 * i + 2], 'held', fmt(reserve)) end
end
redis.call('HSET', KEYS[1], rid, record(reserve, tokens, 0))
redis.call('ZADD', KEYS[2], NOW + ttl, rid)
return {'ok'}
