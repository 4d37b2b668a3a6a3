-- A part claimed (lowest queued part, FOR UPDATE SKIP LOCKED) and its
-- claim recorded; then released with its 64 chunk hashes (queued again
-- here, so the parts never run out).
BEGIN;
SELECT part AS p, lease_epoch + 1 AS e FROM transfer_parts
    WHERE transfer = 1 AND state = 'queued' ORDER BY part LIMIT 1 FOR UPDATE SKIP LOCKED \gset
UPDATE transfer_parts SET state = 'held', holder = 'agent-' || :client_id,
    lease_until = CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT) + 10000, lease_epoch = :e
    WHERE transfer = 1 AND part = :p;
INSERT INTO part_claims VALUES (1, :p, :e, 'agent-' || :client_id,
    CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT), NULL, NULL);
COMMIT;
BEGIN;
UPDATE transfer_parts SET state = 'queued', holder = NULL, lease_until = NULL,
    hashes = decode(repeat('ab', 2048), 'hex'), versions = '[]'
    WHERE transfer = 1 AND part = :p AND holder = 'agent-' || :client_id AND lease_epoch = :e;
UPDATE part_claims SET ended_at = CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT),
    end_reason = 'released' WHERE transfer = 1 AND part = :p AND epoch = :e AND ended_at IS NULL;
COMMIT;
