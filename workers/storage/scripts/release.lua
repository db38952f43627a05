-- Release the model claim, if the caller still holds it (a worker that lost its claim must not
-- delete its successor's).
-- KEYS[1] model claim   ARGV[1] the caller's claim token
-- Returns 1 when released, else 0
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
