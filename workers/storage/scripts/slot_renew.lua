-- Renew a held slot's lease while its model call runs.
-- KEYS[1] the limit's holders
-- ARGV[1] JSON {token, lease_ms}
-- Returns 1 when renewed, 0 when `token` holds no slot any more (its lease ran out: it is not
-- taken back, since another call may have its slot now)

local a = cjson.decode(ARGV[1])
if not redis.call('ZSCORE', KEYS[1], a.token) then return 0 end
slot_hold(KEYS[1], a.token, slot_now_ms() + a.lease_ms)
return 1
