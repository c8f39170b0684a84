-- Shared by the budget scripts (policies/shared_state/redis_budgets.py prepends it to each).
-- KEYS[1] holds (hash: request key -> "remaining\tcharged tokens\tcharged usd\tscope keys..."),
-- KEYS[2] deadlines (sorted set: request key -> when its hold expires), then per scope
-- three keys: req (hash: second -> requests), tok (hash: second -> tokens), s (hash: spend).
local WINDOW = 60

local function fmt(x) return string.format('%.17g', x) end

local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- Days since 1970-01-01 to a civil date and back (H. Hinnant's algorithms), for UTC days and months.
local function civil(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m, d
end

local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  return era * 146097 + yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy - 719468
end

local NOW = clock()
local SEC = math.floor(NOW)
local DAYS = math.floor(NOW / 86400)
local Y, M, D = civil(DAYS)
local DAY = string.format('%04d-%02d-%02d', Y, M, D)
local MONTH = string.sub(DAY, 1, 7)
local UNTIL_DAY = (DAYS + 1) * 86400 - NOW
local UNTIL_MONTH
if M == 12 then UNTIL_MONTH = days_from_civil(Y + 1, 1, 1) * 86400 - NOW
else UNTIL_MONTH = days_from_civil(Y, M + 1, 1) * 86400 - NOW end
local NSCOPES = math.floor((#KEYS - 2) / 3)

-- The total of the last WINDOW one-second buckets, and those buckets; older ones are dropped.
local function window(key)
  local flat = redis.call('HGETALL', key)
  local total, buckets = 0, {}
  for i = 1, #flat, 2 do
    local s = tonumber(flat[i])
    if s <= SEC - WINDOW then
      redis.call('HDEL', key, flat[i])
    else
      local c = tonumber(flat[i + 1])
      total = total + c
      buckets[#buckets + 1] = {s, c}
    end
  end
  return math.max(0, total), buckets
end

-- Seconds until the oldest buckets holding at least `excess` have left the window.
local function retry(buckets, excess)
  table.sort(buckets, function(a, b) return a[1] < b[1] end)
  local freed = 0
  for _, b in ipairs(buckets) do
    freed = freed + b[2]
    if freed >= excess then return math.max(0, b[1] + WINDOW - NOW) end
  end
  return WINDOW
end

local function add(key, amount)
  if amount ~= 0 then
    redis.call('HINCRBYFLOAT', key, SEC, fmt(amount))
    redis.call('EXPIRE', key, 2 * WINDOW)
  end
end

-- Today's spend, this month's and what is held, with the day and month rolled over first.
local function spend(skey)
  local v = redis.call('HMGET', skey, 'day', 'd', 'month', 'm', 'held')
  local d, m = tonumber(v[2]) or 0, tonumber(v[4]) or 0
  if v[1] ~= DAY then d = 0; redis.call('HSET', skey, 'day', DAY, 'd', 0) end
  if v[3] ~= MONTH then m = 0; redis.call('HSET', skey, 'month', MONTH, 'm', 0) end
  redis.call('EXPIRE', skey, 35 * 86400)
  return d, m, math.max(0, tonumber(v[5]) or 0)
end

local function add_spend(skey, usd)
  spend(skey)
  if usd ~= 0 then
    redis.call('HINCRBYFLOAT', skey, 'd', fmt(usd))
    redis.call('HINCRBYFLOAT', skey, 'm', fmt(usd))
  end
end

local function unhold(skey, usd)
  if usd > 0 then
    local left = tonumber(redis.call('HINCRBYFLOAT', skey, 'held', fmt(-usd)))
    if left < 1e-12 then redis.call('HSET', skey, 'held', 0) end  -- float residue is zero
  end
end

local function split(rec)
  local parts = {}
  for p in string.gmatch(rec, '[^\t]+') do parts[#parts + 1] = p end
  return parts
end

local function record(remaining, tokens, usd, first)
  local parts = {fmt(remaining), fmt(tokens), fmt(usd)}
  for i = 1, NSCOPES do parts[#parts + 1] = KEYS[2 + 3 * i] end
  return table.concat(parts, '\t')
end

-- Release the holds of requests past their deadline (their replica never settled them).
local function sweep()
  local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', NOW, 'LIMIT', 0, 64)
  for _, k in ipairs(gone) do
    local rec = redis.call('HGET', KEYS[1], k)
    if rec then
      local parts = split(rec)
      for i = 4, #parts do unhold(parts[i], tonumber(parts[1])) end
      redis.call('HDEL', KEYS[1], k)
    end
    redis.call('ZREM', KEYS[2], k)
  end
end

sweep()
