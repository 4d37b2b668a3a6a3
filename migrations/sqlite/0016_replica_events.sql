-- Ferry catalog, version 16 (SQLite dialect; PostgreSQL:
-- migrations/postgres/0016_replica_events.sql): the sink's publish events,
-- an append-only log that `GET /v1/replicas/events` replays and streams
-- and webhooks deliver (ARCHITECTURE.md, "Publish events"). Each row is
-- written in the transaction of the change it announces; rows older than
-- 7 days are deleted. Times are Unix milliseconds.
CREATE TABLE replica_events (
    -- The event's id: the server-sent event id clients resume after.
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    at_ms       BIGINT NOT NULL,
    -- 'published', 'replaced' (a newer version of the same checkpoint
    -- was published: `replaced_by`) or 'removed'.
    kind        TEXT   NOT NULL,
    -- The replica (replicas.id) and what identifies its checkpoint.
    replica     BIGINT NOT NULL,
    job         TEXT   NOT NULL,
    rel         TEXT   NOT NULL,
    source_path TEXT   NOT NULL,
    step        BIGINT,
    profile     TEXT   NOT NULL,
    -- Where the replica is (a local path or an hdfs:// or s3:// URL).
    location    TEXT   NOT NULL,
    replaced_by BIGINT
);
CREATE INDEX replica_events_at ON replica_events (at_ms);

-- How far each webhook (`[[sink.webhooks]]`, by URL) has delivered.
CREATE TABLE webhook_positions (
    url        TEXT   PRIMARY KEY,
    last_event BIGINT NOT NULL
);
