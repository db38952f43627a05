-- The one extraction a memory partition runs at a time: its lease.
-- KEYS[1] lease   KEYS[2] pending (hash)   KEYS[3] queued flag
-- ARGV[1] JSON {op: "take" | "renew" | "release", token, lease_ms}
-- take: {1, pending turns} taken (the queued flag is cleared: turns ending from now on enqueue a new
--   message), or {0, ms left on the holder's lease} when another holds it. The holder's token is its
--   stage message's id, so a redelivery of that message (its worker died, or it is retried) takes
--   the lease again at once
-- renew: {1, 0} renewed, {0, 0} the lease is not the caller's any more
-- release: {0, 0} released (no turn pending); {1, n} kept, because n turns are pending (the holder
--   takes them next, so no turn waits for a message that bounced off its lease); {-1, 0} not the
--   caller's lease

local a = cjson.decode(ARGV[1])
local lease, pending, flag = KEYS[1], KEYS[2], KEYS[3]
if a.op == 'take' then
  local holder = redis.call('GET', lease)
  if holder and holder ~= a.token then return {0, math.max(redis.call('PTTL', lease), 0)} end
  redis.call('SET', lease, a.token, 'PX', a.lease_ms)
  redis.call('DEL', flag)
  return {1, redis.call('HLEN', pending)}
end
if redis.call('GET', lease) ~= a.token then
  return {a.op == 'renew' and 0 or -1, 0}
end
if a.op == 'renew' then
  redis.call('PEXPIRE', lease, a.lease_ms)
  return {1, 0}
end
local n = redis.call('HLEN', pending)
if n > 0 then
  redis.call('PEXPIRE', lease, a.lease_ms)
  redis.call('DEL', flag)
  return {1, n}
end
redis.call('DEL', lease)
return {0, 0}
