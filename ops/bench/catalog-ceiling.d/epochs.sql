-- A sink agent's read to fence one group of chunks: the epochs of the
-- parts the group falls in (one or two; by primary key).
\set p random(0, 9698)
SELECT part, epoch, first_key, end_key FROM part_epochs WHERE replica = 1 AND part IN (:p, :p + 1) ORDER BY part;
