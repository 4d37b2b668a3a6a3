-- A heartbeat: the agent's row, then its held parts' leases renewed.
BEGIN;
UPDATE agents SET heartbeat_at = CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)
    WHERE name = 'agent-' || :client_id;
UPDATE transfer_parts SET lease_until = CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT) + 10000
    WHERE holder = 'agent-' || :client_id AND state = 'held';
COMMIT;
