-- Ferry catalog, version 15: deadlines (ARCHITECTURE.md, "Deadlines").
-- A transfer or an announcement may say when its replica must be ready:
-- `deadline_at` (Unix ms), or `deadline_after_commit` (ms after the
-- checkpoint's commit, which sets `deadline_at` once the commit is seen).
-- `deadline_state` is NULL while nothing was said about it, then
-- 'at_risk' (the fluid model's ready time passed the deadline, said once),
-- 'met' or 'missed' (said once); it only moves forward.
ALTER TABLE transfers ADD COLUMN deadline_at BIGINT;
ALTER TABLE transfers ADD COLUMN deadline_after_commit BIGINT;
ALTER TABLE transfers ADD COLUMN deadline_state TEXT;
