-- One sink batch: 64 verified 4 MiB chunks recorded, bytes_done bumped.
\set base random(0, 100000000) * 64
BEGIN;
INSERT INTO chunks SELECT 1, :base + g, decode(md5(g::text) || md5((g + 1)::text), 'hex'), 4194304,
    CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT) FROM generate_series(0, 63) g
    ON CONFLICT DO NOTHING;
UPDATE replicas SET bytes_done = bytes_done + 268435456 WHERE id = 1;
COMMIT;
