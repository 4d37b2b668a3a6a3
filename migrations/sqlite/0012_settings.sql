-- Ferry catalog, version 12: the pool's shared settings (ARCHITECTURE.md,
-- "Pool"). On PostgreSQL every agent of the site's pool reads them: the
-- scheduler's policy (`scheduler.max_active`, ...) and each link's rate
-- cap (`link.NAME.rate`, the pool's budget on it). The first agent to
-- start writes its config's values when a row is absent; later changes
-- come through the API (`PUT /v1/settings/{name}`, `ferry pool set`).
-- A single agent on SQLite keeps its config's values and writes no row.
CREATE TABLE settings (
    name       TEXT   PRIMARY KEY,
    -- The value as JSON: a number, or a string for a duration ("10m")
    -- or the policy's name.
    value      TEXT   NOT NULL,
    -- Unix milliseconds of the write.
    updated_at BIGINT NOT NULL,
    -- Who wrote it: 'config of AGENT' for a seeded value, else the API
    -- token's name.
    updated_by TEXT   NOT NULL
);
