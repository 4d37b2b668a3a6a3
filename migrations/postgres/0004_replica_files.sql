-- The file table of each sink-side replica moves out of the replicas row
-- (PostgreSQL dialect of migrations/sqlite/0004_replica_files.sql).
-- SQLite rewrites a whole row on every UPDATE; with the file table of a
-- 100,000-file checkpoint (megabytes of JSON) in the row, every bytes_done
-- update cost time in proportion to the file count, so receiving many small
-- files was quadratic. `replicas.files` stays (NOT NULL) and is left empty.
CREATE TABLE replica_files (
    replica BIGINT  PRIMARY KEY,
    files   TEXT    NOT NULL
);
INSERT INTO replica_files (replica, files) SELECT id, files FROM replicas;
UPDATE replicas SET files = '';
