-- Ferry catalog, version 8: the site's pool of agents (ARCHITECTURE.md,
-- "Pool"). Times are Unix milliseconds of the database's clock.

-- One row per agent that opened this catalog. An agent writes
-- heartbeat_at every heartbeat interval; it is down once heartbeat_at is
-- more than its own timeout_ms in the past (each agent records the
-- timeout it runs with, so every agent judges it alike).
CREATE TABLE agents (
    name         TEXT    PRIMARY KEY,
    -- 'source', 'sink' or 'both'.
    role         TEXT    NOT NULL,
    -- The ferry version the agent runs (Cargo package version).
    version      TEXT    NOT NULL,
    -- The agent's REST API, e.g. http://127.0.0.1:8080.
    api_url      TEXT    NOT NULL,
    started_at   BIGINT  NOT NULL,
    heartbeat_at BIGINT  NOT NULL,
    timeout_ms   BIGINT  NOT NULL,
    -- 1 while the agent is drained: it claims nothing new.
    draining     INTEGER NOT NULL DEFAULT 0,
    -- Payload rates at the last heartbeat, bit/s: sent as a source,
    -- received as a sink.
    sent_bps     DOUBLE PRECISION NOT NULL DEFAULT 0,
    received_bps DOUBLE PRECISION NOT NULL DEFAULT 0,
    -- 1 once the agent stopped cleanly (it holds nothing then).
    stopped      INTEGER NOT NULL DEFAULT 0
);

-- A transfer's lease: the agent running it (holder) until lease_until,
-- renewed with every heartbeat. Another agent may claim it once
-- lease_until has passed; every claim takes the next lease_epoch.
ALTER TABLE transfers ADD COLUMN holder TEXT;
ALTER TABLE transfers ADD COLUMN lease_until BIGINT;
ALTER TABLE transfers ADD COLUMN lease_epoch BIGINT NOT NULL DEFAULT 0;

-- Every lease ever taken: who held a transfer from claimed_at to
-- ended_at (released, or lease_until of a lease that lapsed). Two leases
-- of one transfer never overlap in time.
CREATE TABLE transfer_leases (
    transfer   BIGINT  NOT NULL,
    epoch      BIGINT  NOT NULL,
    agent      TEXT    NOT NULL,
    claimed_at BIGINT  NOT NULL,
    ended_at   BIGINT,
    -- 'released' (the run ended or stopped) or 'lapsed' (not renewed in
    -- time: the agent died, hung or lost the catalog).
    end_reason TEXT,
    PRIMARY KEY (transfer, epoch)
);
CREATE INDEX transfers_holder ON transfers (holder);

