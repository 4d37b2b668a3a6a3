-- Ferry catalog, version 3: the priority scheduler (DESIGN "Classes and
-- score", "Control path"). Jobs and their importance, anomaly signals,
-- per-transfer overrides, and when each chunk arrived at the sink.
-- Times are Unix milliseconds. Portable SQL (SQLite now, Postgres later).

-- Source side: a per-transfer importance override, 0..1. NULL = the job's
-- importance (jobs.importance, 0 for a job nobody described).
ALTER TABLE transfers ADD COLUMN importance REAL;
-- While now < urgent_until (Unix ms) the transfer is 'urgent' because a
-- signal promoted it; `class` keeps the class it returns to afterwards.
-- NULL = not promoted. Setting the class by hand clears it.
ALTER TABLE transfers ADD COLUMN urgent_until BIGINT;
-- The signal (signals.id) that promoted the transfer, if any.
ALTER TABLE transfers ADD COLUMN signal BIGINT;
-- A signal promotes its job's newest unpublished transfer: find it fast.
CREATE INDEX transfers_job ON transfers (job, created_at);

-- Sink side: when a chunk was verified (Unix ms, the sink's clock) and its
-- length in bytes, so tests and the benchmark can see which transfer's
-- bytes arrived when. NULL for rows written before version 3 and for rows
-- carried over when a resumed transfer's file table was renumbered.
ALTER TABLE chunks ADD COLUMN verified_at BIGINT;
ALTER TABLE chunks ADD COLUMN bytes BIGINT;
-- Sink side: when the chunk's first byte was read (Unix ms); its bytes
-- count as arriving evenly from then to verified_at.
ALTER TABLE chunks ADD COLUMN arrival_started BIGINT;
-- Sink side: what the chunk rows said about arrival once they are gone
-- (they are dropped at publish): JSON {"bin_ms": width, "bins": [[bin
-- start (Unix ms), bytes], ...]}, oldest first; bins are 10 ms wide, or
-- ten times wider until at most 10,000 cover the transfer.
ALTER TABLE replicas ADD COLUMN arrivals TEXT;

-- Source side: jobs (training runs) the scheduler ranks by. A row comes
-- from the config file (origin 'config', rewritten at every start) or the
-- API (origin 'api', kept across restarts until set again).
CREATE TABLE jobs (
    name         TEXT    PRIMARY KEY,
    -- Model size in parameters; NULL = unknown (the size term is 1).
    model_params REAL,
    -- Importance 0..1.
    importance   REAL    NOT NULL DEFAULT 0,
    -- 'config' or 'api'.
    origin       TEXT    NOT NULL,
    updated_at   BIGINT  NOT NULL
);

-- Source side: anomaly reports from training controllers (POST
-- /v1/signals). A job's live severity is the largest decayed severity of
-- its recent signals.
CREATE TABLE signals (
    id              INTEGER PRIMARY KEY,
    job             TEXT    NOT NULL,
    -- What was seen: loss spike, grad-norm spike, NaN, eval regression,
    -- manual (the API defines the names).
    kind            TEXT    NOT NULL,
    -- 0..1 when received; it decays with the configured half-life.
    severity        REAL    NOT NULL,
    -- Training step the controller reported, if any.
    step            BIGINT,
    -- A client's retry key: a second signal with the same key is the
    -- first one again, not a new signal. NULL = no key.
    idempotency_key TEXT    UNIQUE,
    -- The transfer (transfers.id) the signal promoted to 'urgent', if any.
    transfer        BIGINT,
    received_at     BIGINT  NOT NULL
);
CREATE INDEX signals_job_received ON signals (job, received_at);
