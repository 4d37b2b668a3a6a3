-- Ferry catalog, version 21: a striped transfer's plan is announced to the
-- pool only once its coordinator's open reached the sink (ARCHITECTURE.md,
-- "Pool", "Parts").

-- 0 while only the agent that stored the plan may claim its parts: the
-- coordinator stores the plan, sends its open, claims its first parts and
-- sends their registrations without waiting in between; once the sink's
-- answer to the open came (its row for the transfer exists), the plan is
-- announced (1) and every agent of the pool may claim. Plans stored
-- before this version count as announced.
ALTER TABLE transfer_plans ADD COLUMN announced BIGINT NOT NULL DEFAULT 1;
