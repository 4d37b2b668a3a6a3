-- Ferry catalog, version 22: a quiet plan may be announced to the agents
-- whose sink takes joining opens (wire version 11) before it is announced
-- to every agent (ARCHITECTURE.md, "Pool", "Joining opens").

-- 1 once the coordinator sent its open and its first parts: an agent whose
-- connection to the sink speaks version 11 may claim the plan's parts (its
-- open waits at the sink for the coordinator's row). `announced` stays 0
-- until the sink answered the coordinator's open, so agents from before
-- this version, which read only `announced`, still see a quiet plan (and
-- one that takes the transfer over announces it).
ALTER TABLE transfer_plans ADD COLUMN joinable BIGINT NOT NULL DEFAULT 0;
