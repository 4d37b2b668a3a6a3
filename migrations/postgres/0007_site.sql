-- PostgreSQL only: the site whose agents share this database (one
-- database per site). The first agent to open the catalog records its
-- site here; an agent of another site is refused, naming both. An SQLite
-- catalog belongs to one agent's data directory and has no such row.
CREATE TABLE catalog_site (
    -- Always 1: the table holds at most one row.
    id          BIGINT  PRIMARY KEY CHECK (id = 1),
    site        TEXT    NOT NULL,
    -- When it was recorded, Unix ms.
    recorded_at BIGINT  NOT NULL
);
