-- Ferry catalog, version 9: the catalog's own identity, made at the
-- first open (a random 128-bit id, hex). A source sends it with each
-- transfer it opens (wire protocol 5), and the sink keys the transfer's
-- row by it, the source site and the transfer id: another agent sharing
-- this catalog continues a transfer where the first left off, and two
-- catalogs of one site never collide. `ferry catalog migrate` carries it
-- over to PostgreSQL.
CREATE TABLE catalog_identity (
    -- Always 1: the table holds at most one row.
    id         BIGINT PRIMARY KEY CHECK (id = 1),
    catalog_id TEXT   NOT NULL
);
