-- Ferry catalog, version 10: which process an agent's row belongs to (a
-- random id each `ferry serve` makes at start). A second process with
-- the name of a live agent is refused until that agent stops or its
-- heartbeat lapses, so one name never runs twice in a pool.
ALTER TABLE agents ADD COLUMN instance TEXT NOT NULL DEFAULT '';
