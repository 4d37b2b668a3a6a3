-- Ferry catalog, version 19: publish leases of a sink pool
-- (ARCHITECTURE.md, "Pool", "Sink pool"). Times are Unix milliseconds of
-- the database's clock.

-- The sink agents of a site share one sink root; one of them at a time
-- moves a version into a given published path, under a lease on that
-- path renewed with its heartbeat like a transfer's. If it dies, another
-- sink agent takes the lease once lease_until has passed (under the next
-- lease_epoch) and finishes the publish from what is on disk. A row
-- stays after its release (holder NULL), so epochs keep counting.
CREATE TABLE publish_leases (
    local_path  TEXT    PRIMARY KEY,
    -- The sink's replica row the holder publishes.
    replica     BIGINT,
    holder      TEXT,
    lease_until BIGINT,
    lease_epoch BIGINT  NOT NULL DEFAULT 0,
    -- When the holder claimed it.
    claimed_at  BIGINT
);
