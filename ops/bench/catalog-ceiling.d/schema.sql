-- Tables of the catalog's shape (migrations/postgres 0001, 0008, 0020),
-- filled as for one 2.6 TB checkpoint: 4 MiB chunks, parts of 256 MiB
-- (9,700 parts), 16 source agents, one replica row at the sink.
CREATE TABLE agents (name TEXT PRIMARY KEY, heartbeat_at BIGINT NOT NULL, timeout_ms BIGINT NOT NULL);
CREATE TABLE replicas (id BIGINT PRIMARY KEY, bytes_done BIGINT NOT NULL);
CREATE TABLE chunks (replica BIGINT NOT NULL, idx BIGINT NOT NULL, hash BYTEA NOT NULL,
    len BIGINT NOT NULL, arrived_at BIGINT NOT NULL, PRIMARY KEY (replica, idx));
CREATE TABLE transfer_parts (transfer BIGINT NOT NULL, part BIGINT NOT NULL,
    first_key BIGINT NOT NULL, end_key BIGINT NOT NULL, bytes BIGINT NOT NULL,
    state TEXT NOT NULL DEFAULT 'queued', holder TEXT, lease_until BIGINT,
    lease_epoch BIGINT NOT NULL DEFAULT 0, done_by TEXT, hashes BYTEA, versions TEXT,
    PRIMARY KEY (transfer, part));
CREATE INDEX transfer_parts_state ON transfer_parts (state, transfer);
CREATE TABLE part_claims (transfer BIGINT NOT NULL, part BIGINT NOT NULL, epoch BIGINT NOT NULL,
    agent TEXT NOT NULL, claimed_at BIGINT NOT NULL, ended_at BIGINT, end_reason TEXT,
    PRIMARY KEY (transfer, part, epoch));
CREATE TABLE part_epochs (replica BIGINT NOT NULL, part BIGINT NOT NULL, epoch BIGINT NOT NULL,
    first_key BIGINT NOT NULL, end_key BIGINT NOT NULL, registered_by TEXT NOT NULL,
    registered_at BIGINT NOT NULL, PRIMARY KEY (replica, part));
INSERT INTO agents SELECT 'agent-' || g, 0, 10000 FROM generate_series(0, 63) g;
INSERT INTO replicas VALUES (1, 0);
INSERT INTO transfer_parts (transfer, part, first_key, end_key, bytes)
    SELECT 1, g, g * 64, (g + 1) * 64, 268435456 FROM generate_series(0, 9699) g;
INSERT INTO part_epochs SELECT 1, g, 1, g * 64, (g + 1) * 64, 'agent-0', 0 FROM generate_series(0, 9699) g;
ANALYZE;
