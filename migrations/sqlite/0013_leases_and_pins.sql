-- Ferry catalog, version 13: reader leases bound to a replica version, and
-- pins asked for by signals
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

-- Pins a source asked for because of an anomaly signal (protocol version
-- 6): pin the replica of `job` from `source_site` that `target` names
-- ('newest', 'step' = the replica of `step`, 'at_or_after' = the one with
-- the smallest step at or above `step`), until `until` (Unix ms). Applied
-- when that replica is present, or once it is published before `until`;
-- `applied_to` is then the replica's id.
CREATE TABLE pin_requests (
    id          INTEGER PRIMARY KEY,
    source_site TEXT   NOT NULL,
    job         TEXT   NOT NULL,
    target      TEXT   NOT NULL,
    step        BIGINT,
    reason      TEXT   NOT NULL,
    created_at  BIGINT NOT NULL,
    until       BIGINT NOT NULL,
    applied_to  BIGINT
);
CREATE INDEX pin_requests_pending ON pin_requests (applied_to, until);
