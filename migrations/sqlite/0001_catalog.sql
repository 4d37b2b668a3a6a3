-- Ferry catalog, version 1. Portable SQL (SQLite now, Postgres later).
-- Times are Unix milliseconds. Hashes are 32-byte BLAKE3 values.

-- Source side: one row per transfer of a checkpoint (or background copy)
-- over one link. Every state change is written here before it is acted on.
CREATE TABLE transfers (
    id            INTEGER PRIMARY KEY,
    link          TEXT    NOT NULL,
    job           TEXT    NOT NULL,
    source_path   TEXT    NOT NULL,
    rel           TEXT    NOT NULL,
    class         TEXT    NOT NULL DEFAULT 'scheduled',
    state         TEXT    NOT NULL,
    bytes_total   BIGINT  NOT NULL DEFAULT 0,
    bytes_done    BIGINT  NOT NULL DEFAULT 0,
    bytes_sent    BIGINT  NOT NULL DEFAULT 0,
    shards        BIGINT  NOT NULL DEFAULT 0,
    manifest_root TEXT,
    local_path    TEXT,
    error         TEXT,
    created_at    BIGINT  NOT NULL,
    started_at    BIGINT,
    finished_at   BIGINT
);
CREATE INDEX transfers_state ON transfers (state);
CREATE INDEX transfers_source_path ON transfers (source_path);

-- Sink side: one row per incoming transfer; a published row is a replica.
CREATE TABLE replicas (
    id              INTEGER PRIMARY KEY,
    peer            TEXT    NOT NULL,
    source_site     TEXT    NOT NULL,
    source_transfer BIGINT  NOT NULL,
    job             TEXT    NOT NULL,
    source_path     TEXT    NOT NULL,
    rel             TEXT    NOT NULL,
    chunk_size      BIGINT  NOT NULL,
    files           TEXT    NOT NULL,
    manifest        BLOB,
    manifest_root   TEXT,
    state           TEXT    NOT NULL,
    bytes_total     BIGINT  NOT NULL,
    bytes_done      BIGINT  NOT NULL DEFAULT 0,
    staging_path    TEXT    NOT NULL,
    local_path      TEXT    NOT NULL,
    error           TEXT,
    created_at      BIGINT  NOT NULL,
    published_at    BIGINT,
    UNIQUE (peer, source_transfer, source_path)
);
CREATE INDEX replicas_source_path ON replicas (source_path);
CREATE INDEX replicas_local_path ON replicas (local_path);

-- Sink side: chunks verified in staging; the resume point after a crash.
CREATE TABLE chunks (
    replica BIGINT NOT NULL REFERENCES replicas (id) ON DELETE CASCADE,
    idx     BIGINT NOT NULL,
    hash    BLOB   NOT NULL,
    PRIMARY KEY (replica, idx)
);
