-- Ferry catalog, version 13 (PostgreSQL dialect of
-- migrations/sqlite/0013_leases.sql): reader leases bound to a replica version
-- (ARCHITECTURE.md, "Replica lifecycle"). Times are Unix milliseconds.
-- Each published version lives in its own directory
-- (<sink root>/.ferry/versions/<replica id>); the published path is a
-- symbolic link to the current one. A lease keeps one version's
-- directory until it expires or is released.

-- One row per lease granted by `GET /v1/resolve?lease=`. The id is a
-- random 128-bit value in hex; `holder` is the API token's name.
CREATE TABLE leases (
    id          TEXT   PRIMARY KEY,
    replica     BIGINT NOT NULL,
    holder      TEXT   NOT NULL,
    created_at  BIGINT NOT NULL,
    -- How long each renewal extends it, milliseconds.
    duration_ms BIGINT NOT NULL,
    expires_at  BIGINT NOT NULL,
    -- Set when the holder (or an operator) released it.
    released_at BIGINT
);
CREATE INDEX leases_replica ON leases (replica);

-- The latest expiry of the replica's live leases (NULL: never leased).
-- Kept on the row so that granting a lease and starting a removal, or
-- deleting a replaced version, are decided one after the other on the
-- same row: a removal never starts on a leased version, and a lease is
-- never granted on one whose removal began.
ALTER TABLE replicas ADD COLUMN leased_until BIGINT;
-- When the directory of a version a re-save replaced was deleted (it
-- had no live lease); a lease is never granted on it after.
ALTER TABLE replicas ADD COLUMN version_deleted_at BIGINT;
