-- ARGV: request key, estimated tokens, USD to hold, hold ttl (s), then per scope:
-- requests/min, tokens/min, daily USD, monthly USD ('' = unlimited).
-- Reply: {'ok', then per scope what is left after this request: requests and tokens in the
-- window, daily and monthly USD ('' = unlimited)}, or {kind, scope index, retry after (s), '1'
-- when holds made the difference}. What is left is what a replica may share out while the store
-- is unreachable (state.on_outage: local_share).
local rid, tokens, reserve, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local left = {}
for i = 1, NSCOPES do
  local req, tok, skey = KEYS[3 * i], KEYS[3 * i + 1], KEYS[3 * i + 2]
  local rpm, tpm = tonumber(ARGV[4 * i + 1]), tonumber(ARGV[4 * i + 2])
  local daily, monthly = tonumber(ARGV[4 * i + 3]), tonumber(ARGV[4 * i + 4])
  local l_req, l_tok, l_day, l_month = '', '', '', ''
  if rpm then
    local seen, buckets = window(req)
    if seen + 1 > rpm then return {'rpm', i, fmt(retry(buckets, seen + 1 - rpm))} end
    l_req = fmt(rpm - seen - 1)
  end
  if tpm then
    local used, buckets = window(tok)
    if used + tokens > tpm then
      if tokens > tpm then return {'tpm_big', i, fmt(WINDOW)} end
      return {'tpm', i, fmt(retry(buckets, used + tokens - tpm))}
    end
    l_tok = fmt(tpm - used - tokens)
  end
  local d, m, held = spend(skey)
  if daily and d + held >= daily then
    return {'day', i, fmt(d >= daily and UNTIL_DAY or 1), held > 0 and '1' or '0'}
  end
  if monthly and m + held >= monthly then return {'month', i, fmt(UNTIL_MONTH)} end
  if daily then l_day = fmt(daily - d - held - reserve) end
  if monthly then l_month = fmt(monthly - m - held - reserve) end
  left[#left + 1] = l_req
  left[#left + 1] = l_tok
  left[#left + 1] = l_day
  left[#left + 1] = l_month
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
local reply = {'ok'}
for _, v in ipairs(left) do reply[#reply + 1] = v end
return reply
