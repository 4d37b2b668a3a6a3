-- What a sink agent read to fence one group of chunks until 2026-12-04:
-- every part epoch of the transfer (9,700 rows).
SELECT part, epoch, first_key, end_key FROM part_epochs WHERE replica = 1 ORDER BY part;
