-- A turn that ended joins its memory partition's pending turns (the debounced extraction takes them
-- all); a stage message is enqueued only when none is queued for the partition (the `queued` flag,
-- which the extraction clears when it takes its batch). A turn consolidated already (a redelivered
-- finish) is not noted again.
-- KEYS[1] pending (hash turn id -> turn JSON)   KEYS[2] queued flag   KEYS[3] turns (zset, done)
-- KEYS[4] the user's partitions (set)   KEYS[5] the memory queue's messages   KEYS[6] its list
-- ARGV[1] JSON {turn_id, suffix, flag_ms, message_id, channel, queue}
-- ARGV[2] the pending turn JSON   ARGV[3] the stage message (dramatiq's JSON)
-- Returns 'done' (consolidated already), 'queued' (a message was enqueued) or 'folded' (one was
-- queued already: this turn goes with it)
-- Without KEYS[5] and KEYS[6] (the sharded layout: the queue is in the turn's shard, another slot) the
-- caller enqueues the message when the answer is 'queued'.

local a = cjson.decode(ARGV[1])
if redis.call('ZSCORE', KEYS[3], a.turn_id) then return 'done' end
redis.call('HSET', KEYS[1], a.turn_id, ARGV[2])
redis.call('SADD', KEYS[4], a.suffix)
if not redis.call('SET', KEYS[2], '1', 'NX', 'PX', a.flag_ms) then return 'folded' end
if KEYS[6] then enqueue(KEYS[5], KEYS[6], a.message_id, ARGV[3], a.channel, a.queue) end
return 'queued'
