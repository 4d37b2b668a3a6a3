-- Ferry catalog, version 18: weights-first publishes (ARCHITECTURE.md,
-- "Weights first"). A weights-first transfer has two rows at the sink,
-- made together when it opens: first its weights-only version's (profile
-- 'weights-only', state 'queued' until it is published at the commit;
-- its `peer` is the transfer's with '#weights-only' appended, since the
-- transfer's own row holds the key (peer, source_transfer, source_path)),
-- then the transfer's own row, whose `weights_version` names it. The
-- weights-only row is older, so the full replica, published later,
-- replaces it as the newer version at the same path. NULL elsewhere.
ALTER TABLE replicas ADD COLUMN weights_version BIGINT;
