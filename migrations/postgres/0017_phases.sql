-- Ferry catalog, version 17: where the time to eval-ready went, and the
-- readers a replica expects (ARCHITECTURE.md, "Time to eval-ready"). `phases` is a JSON object
-- {"before": {phase: seconds}, "after": {phase: seconds}}: the durations
-- each phase took before and after the checkpoint's commit, measured on
-- the source's and the sink's monotonic clocks (phase names:
-- announced, queued, streaming, waiting_for_writer, sending, verifying,
-- publishing). On a sink's replica: the source's phases until its commit
-- message went plus the sink's after it arrived; on a source's transfer:
-- the same, recorded when the sink said it published. NULL when unknown
-- (published before this version, or by an older peer).
-- `transfers.readers`: how many readers (eval ranks starting at once) the
-- announcement or the push said to expect, for an HDFS sink's hot-file
-- replication hints; NULL when not said.
ALTER TABLE replicas ADD COLUMN phases TEXT;
ALTER TABLE transfers ADD COLUMN phases TEXT;
ALTER TABLE transfers ADD COLUMN readers BIGINT;
