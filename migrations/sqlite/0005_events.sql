-- Ferry catalog, version 5: the source's scheduling history, an
-- append-only log of the changes the scheduler acts on, for `GET
-- /v1/trace` and `ferry replay` (ARCHITECTURE.md, "Recorded events").
-- Each row is written in the same transaction as the change it records
-- (for a rate change the row is the only record); rows are never updated
-- or deleted. Times are Unix milliseconds. Portable SQL (SQLite now,
-- Postgres later).
CREATE TABLE events (
    id           INTEGER PRIMARY KEY,
    -- When the change was made (Unix ms, the source's clock).
    at_ms        BIGINT  NOT NULL,
    -- 'arrival', 'cancel', 'class', 'importance', 'job', 'pause', 'rate',
    -- 'resume' or 'signal'.
    kind         TEXT    NOT NULL,
    -- The transfer (transfers.id): arrival, cancel, class, importance,
    -- pause, resume.
    transfer     BIGINT,
    -- Link name: arrival, rate.
    link         TEXT,
    -- Job name: arrival, job, signal.
    job          TEXT,
    -- Class name: arrival (the class it was queued in), class (the class
    -- an operator set).
    class        TEXT,
    -- 0..1. arrival: the transfer's own importance when queued (NULL =
    -- the job's counts); importance: the override set (NULL = cleared);
    -- job: the job's importance.
    importance   REAL,
    -- job: model size in parameters (NULL = unknown).
    model_params REAL,
    -- arrival: payload bytes if known when queued (NULL = not yet known;
    -- the export then takes transfers.bytes_total).
    bytes        BIGINT,
    -- rate: the link's new rate cap, bit/s.
    rate_bps     BIGINT,
    -- signal: severity 0..1 when received, and what was seen.
    severity     REAL,
    signal_kind  TEXT
);
CREATE INDEX events_at ON events (at_ms, id);
CREATE INDEX events_transfer ON events (transfer, at_ms);

-- What older versions kept, carried over so that every transfer has its
-- arrival and a trace of the whole history parses: one arrival per
-- transfer at its creation time (with the class and importance it has
-- now: what it had when queued was not kept), each job's values at its
-- last update, and every signal. Rate changes, pauses, resumes, cancels
-- and class and importance changes of older versions were not kept.
INSERT INTO events (at_ms, kind, transfer, link, job, class, importance)
SELECT created_at, 'arrival', id, link, job, class, importance FROM transfers ORDER BY id;
INSERT INTO events (at_ms, kind, job, model_params, importance)
SELECT updated_at, 'job', name, model_params, importance FROM jobs ORDER BY name;
INSERT INTO events (at_ms, kind, job, severity, signal_kind)
SELECT received_at, 'signal', job, severity, kind FROM signals ORDER BY id;
