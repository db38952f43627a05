-- A write of a stage that runs after its turn (compaction: a decision record, a running summary),
-- made only while the conversation exists: a delete between its read and this write must not find
-- it written back.
-- KEYS[1] conversation   KEYS[2] the hash written (the conversation's decisions or summaries)
-- ARGV[1] JSON {field}   ARGV[2] the value
-- Returns 1 (written) | 0 (the conversation is gone)
local a = cjson.decode(ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], a.field, ARGV[2])
return 1
