-- Give a slot back. Only the caller's own token is removed: a token that holds nothing (a wait
-- that was cancelled, a lease that ran out) frees nobody else's slot.
-- KEYS[1] the limit's holders
-- ARGV[1] the caller's token
-- Returns 1 when released, else 0
return redis.call('ZREM', KEYS[1], ARGV[1])
