-- The gateway's rate limits, shared by every gateway process: token buckets (requests per second,
-- turns per minute, failed authentications per address) and, optionally, one of an API key's event
-- stream holds (the key's streams open at once). Every bucket must allow and the hold must be free,
-- or nothing is taken: a refused request costs nothing. Time is this server's (no gateway's clock
-- matters). A bucket holds `burst` tokens, refills `rate` per second, and is absent when full: it
-- expires once it would have refilled.
-- KEYS[1..n] the buckets (n = #ARGV.buckets)   KEYS[n+1] the key's stream holders (only with `hold`)
-- ARGV[1] JSON {buckets: [{rate, burst, cost}], hold: {token, limit, lease_ms} (optional)}
--               cost 0 takes nothing: it asks whether a token is left (auth failures, before a look-up)
-- Returns {1, 0, 0} when allowed (costs and hold taken),
-- {0, retry_after_ms, i} when bucket i (1-based) is short, {0, retry_after_ms, 0} when every stream
-- hold is taken

local a = cjson.decode(ARGV[1])
local now = slot_now_ms()
local buckets = a.buckets or {}
local levels = {}

for i, b in ipairs(buckets) do
  local stored = redis.call('HMGET', KEYS[i], 'tokens', 'at')
  local tokens = b.burst
  if stored[1] then
    tokens = math.min(b.burst, tonumber(stored[1]) + (now - tonumber(stored[2])) * b.rate / 1000)
  end
  local need = math.max(b.cost, 1)
  if tokens < need then
    return {0, math.ceil((need - tokens) * 1000 / b.rate), i}
  end
  levels[i] = tokens
end

if a.hold then
  local holders = KEYS[#buckets + 1]
  redis.call('ZREMRANGEBYSCORE', holders, '-inf', string.format('%.0f', now))
  if not redis.call('ZSCORE', holders, a.hold.token)
      and redis.call('ZCARD', holders) >= a.hold.limit then
    return {0, 1000, 0}
  end
  slot_hold(holders, a.hold.token, now + a.hold.lease_ms)
end

for i, b in ipairs(buckets) do
  if b.cost > 0 then
    redis.call('HSET', KEYS[i], 'tokens', string.format('%.6f', levels[i] - b.cost), 'at', string.format('%.0f', now))
    redis.call('PEXPIRE', KEYS[i], math.ceil(b.burst * 1000 / b.rate) + 1000)
  end
end
return {1, 0, 0}
