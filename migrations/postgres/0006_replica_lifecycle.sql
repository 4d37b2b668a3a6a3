-- Ferry catalog, version 6: the sink's replica lifecycle (ARCHITECTURE.md,
-- "Replica lifecycle"). Times are Unix milliseconds. PostgreSQL dialect
-- of migrations/sqlite/0006_replica_lifecycle.sql.

-- What a version 3 source sends at commit: the checkpoint's training step
-- (NULL: none or unknown) and its scheduler class then (NULL: unknown, a
-- version 2 source).
ALTER TABLE replicas ADD COLUMN step BIGINT;
ALTER TABLE replicas ADD COLUMN class TEXT;

-- An operator's pin: a pinned replica never expires and is removed by
-- hand only with force. pinned_until NULL = until unpinned.
ALTER TABLE replicas ADD COLUMN pinned_at BIGINT;
ALTER TABLE replicas ADD COLUMN pinned_until BIGINT;
ALTER TABLE replicas ADD COLUMN pin_reason TEXT;

-- A removal (state 'removing' while its files are deleted, then
-- 'removed'): why ('rule', 'pressure' or 'operator'), the rule or note
-- (the policy, the operator's reason), when it was taken out of the
-- published namespace, when its files were gone, the bytes it freed, and
-- whether an operator forced it past a pin (1).
ALTER TABLE replicas ADD COLUMN removal_reason TEXT;
ALTER TABLE replicas ADD COLUMN removal_detail TEXT;
ALTER TABLE replicas ADD COLUMN removal_started_at BIGINT;
ALTER TABLE replicas ADD COLUMN removed_at BIGINT;
ALTER TABLE replicas ADD COLUMN removed_bytes BIGINT;
ALTER TABLE replicas ADD COLUMN removal_forced BIGINT NOT NULL DEFAULT 0;
CREATE INDEX replicas_state ON replicas (state);
