-- Raise a turn's cancel flag (durable, with a TTL) and tell every worker process; a no-op for a
-- turn that has ended.
-- KEYS[1] cancel flag   KEYS[2] turn
-- ARGV[1] JSON {turn_id, reason, ttl_s, channel, now}
-- Returns {'noop', status} | {'signalled', status or 'unknown'}
local a = cjson.decode(ARGV[1])
local status = raise_cancel(KEYS[1], KEYS[2], a.turn_id, a.reason, a.ttl_s, a.channel, a.now)
if not status then return {'noop', redis.call('HGET', KEYS[2], 'status')} end
return {'signalled', status}
