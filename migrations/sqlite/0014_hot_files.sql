-- Ferry catalog, version 14: replication hints for the hot files of a
-- replica at an HDFS sink (ARCHITECTURE.md, "Storage backends"). The
-- files every eval rank reads (`.metadata`, `metadata.json`, `common.pt`,
-- `*.index.json`, `config.json`, ...) get a higher HDFS replication factor
-- before the publish, and the factor they had before once `hot_until`
-- (Unix ms) has passed. NULL: no hint given, or it has ended.
ALTER TABLE replicas ADD COLUMN hot_factor INTEGER;
ALTER TABLE replicas ADD COLUMN hot_previous INTEGER;
ALTER TABLE replicas ADD COLUMN hot_until BIGINT;
