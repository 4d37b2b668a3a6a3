-- Ferry catalog, version 2: checkpoints watched while they are written,
-- and the replication lag of each replica (ARCHITECTURE.md, "Measures").

-- Source side: the state of the checkpoint a transfer copies, as the
-- watcher last saw it: 'open' (being written), 'committed', 'abandoned'
-- or 'deleted'. `ferry push` and background copies are 'committed'.
ALTER TABLE transfers ADD COLUMN checkpoint TEXT NOT NULL DEFAULT 'committed';
-- Format that recognised the checkpoint ('dcp', 'hf', ...), if watched.
ALTER TABLE transfers ADD COLUMN format TEXT;
-- When the checkpoint opened (first file or directory) and was committed
-- (its marker appeared), Unix ms.
ALTER TABLE transfers ADD COLUMN opened_at BIGINT;
ALTER TABLE transfers ADD COLUMN committed_at BIGINT;
-- Commit identity (marker size and mtime, or the like): a new identity in
-- the same directory is a re-save.
ALTER TABLE transfers ADD COLUMN commit_identity TEXT;
-- Replication profile: NULL for every file, 'weights-only' for a replica
-- without optimizer state (formats that keep it in separate files).
ALTER TABLE transfers ADD COLUMN profile TEXT;

-- Sink side: the source's open and commit times (Unix ms, the source's
-- clock) and the lags measured at publish, in seconds.
ALTER TABLE replicas ADD COLUMN opened_at BIGINT;
ALTER TABLE replicas ADD COLUMN committed_at BIGINT;
ALTER TABLE replicas ADD COLUMN commit_to_replica_s DOUBLE PRECISION;
ALTER TABLE replicas ADD COLUMN open_to_replica_s DOUBLE PRECISION;
ALTER TABLE replicas ADD COLUMN profile TEXT;
