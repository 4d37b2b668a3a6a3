-- Ferry catalog, version 11: watches of source roots in a pool
-- (ARCHITECTURE.md, "Pool"). Times are Unix milliseconds.

-- Each watched source root (keyed by its path, as every source agent of
-- the pool reads it) is watched by one agent at a time under a lease of
-- the database's clock, renewed with the agent's heartbeat like a
-- transfer's; another agent takes the watch over once lease_until has
-- passed, under the next lease_epoch.
CREATE TABLE watches (
    root        TEXT    PRIMARY KEY,
    holder      TEXT,
    lease_until BIGINT,
    lease_epoch BIGINT  NOT NULL DEFAULT 0,
    -- When the holder claimed it (database clock).
    claimed_at  BIGINT
);

-- Each source agent's fingerprint of each root it is configured to
-- watch: the names, sizes and mtimes of the root's first 100 regular
-- files (sorted depth-first walk) last modified at or before cutoff_ms
-- (the agent's clock). An agent whose fingerprint disagrees with the
-- watching agent's does not watch the root (it does not see the same
-- storage); verdict says why.
CREATE TABLE root_fingerprints (
    root        TEXT    NOT NULL,
    agent       TEXT    NOT NULL,
    -- JSON: [[relative path, size in bytes, mtime in Unix ms], ...].
    entries     TEXT    NOT NULL,
    cutoff_ms   BIGINT  NOT NULL,
    -- When it was recorded (database clock).
    recorded_at BIGINT  NOT NULL,
    -- NULL while it agrees (or nothing to compare with); otherwise why
    -- the agent refuses to watch the root.
    refused     TEXT,
    PRIMARY KEY (root, agent)
);
