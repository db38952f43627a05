-- An existing version becomes the agent's active one (a rollback): no new version is made, and the
-- activation (who, when) is recorded; the agent's hash keeps the version's document as the active one.
-- KEYS[1] the agent (hash: active, latest, active_config)   KEYS[2] its activations (list, newest first)
-- KEYS[3] the version's config
-- ARGV[1] JSON {version (string)}   ARGV[2] the activation (JSON)
-- Returns 'missing' | 'unchanged' (it is already active) | 'activated'
local a = cjson.decode(ARGV[1])
local config = redis.call('GET', KEYS[3])
if not config then return 'missing' end
if redis.call('HGET', KEYS[1], 'active') == a.version then return 'unchanged' end
redis.call('HSET', KEYS[1], 'active', a.version, 'active_config', config)
redis.call('LPUSH', KEYS[2], ARGV[2])
redis.call('LTRIM', KEYS[2], 0, 999)
return 'activated'
