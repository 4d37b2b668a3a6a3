-- Ferry catalog, version 20: a transfer striped across a source pool
-- (ARCHITECTURE.md, "Pool", "Parts"). Times are Unix milliseconds of the
-- database's clock.

-- The file table of a pushed transfer split into parts, written once by
-- the agent holding the transfer (its coordinator): every agent that
-- sends a part opens the transfer at the sink with this table. The
-- files column is JSON: {"files": [[path, size in bytes, mode, mtime in
-- ns], ...], "markers": [file index, ...]}.
CREATE TABLE transfer_plans (
    transfer    BIGINT  PRIMARY KEY,
    chunk_size  BIGINT  NOT NULL,
    part_size   BIGINT  NOT NULL,
    files       BLOB   NOT NULL,
    planned_by  TEXT    NOT NULL,
    planned_at  BIGINT  NOT NULL,
    -- Claim order across transfers (written by the coordinator from the
    -- link's scheduler): class first (2 urgent, 1 scheduled, 0
    -- background), then the least claimed bytes per unit of score.
    class_rank  BIGINT  NOT NULL DEFAULT 0,
    weight      REAL NOT NULL DEFAULT 1,
    claimed_bytes BIGINT NOT NULL DEFAULT 0
);

-- The parts: chunk keys first_key (included) to end_key (excluded) of
-- the plan's file table, in key order (file << 32 | chunk). A part is
-- queued, held (under a lease renewed by its holder's heartbeat, epoch
-- counting every claim) or done (its chunks verified at the sink). At
-- release the holder records each chunk's BLAKE3 hash (32 bytes each, in
-- key order) and each file's size, mtime and version token before and
-- after its read (JSON), which the coordinator seals the manifest from.
CREATE TABLE transfer_parts (
    transfer    BIGINT  NOT NULL,
    part        BIGINT  NOT NULL,
    first_key   BIGINT  NOT NULL,
    end_key     BIGINT  NOT NULL,
    bytes       BIGINT  NOT NULL,
    state       TEXT    NOT NULL DEFAULT 'queued',
    holder      TEXT,
    lease_until BIGINT,
    lease_epoch BIGINT  NOT NULL DEFAULT 0,
    done_by     TEXT,
    hashes      BLOB,
    versions    TEXT,
    PRIMARY KEY (transfer, part)
);
CREATE INDEX transfer_parts_state ON transfer_parts (state, transfer);

-- Every claim of a part: who, under which epoch, from when to when (the
-- database clock), and how it ended (released, lapsed, requeued).
CREATE TABLE part_claims (
    transfer    BIGINT  NOT NULL,
    part        BIGINT  NOT NULL,
    epoch       BIGINT  NOT NULL,
    agent       TEXT    NOT NULL,
    claimed_at  BIGINT  NOT NULL,
    ended_at    BIGINT,
    end_reason  TEXT,
    PRIMARY KEY (transfer, part, epoch)
);

-- Sink side: the epoch under which a part of a striped transfer was last
-- claimed, as its sender registered it before sending (replica is the
-- sink's replica row). Every sink agent of the site refuses the part's
-- chunks from a sender that registered an older epoch: a source agent
-- that was paused past its lease cannot write after its part was taken
-- over.
CREATE TABLE part_epochs (
    replica       BIGINT  NOT NULL,
    part          BIGINT  NOT NULL,
    epoch         BIGINT  NOT NULL,
    first_key     BIGINT  NOT NULL,
    end_key       BIGINT  NOT NULL,
    registered_by TEXT    NOT NULL,
    registered_at BIGINT  NOT NULL,
    PRIMARY KEY (replica, part)
);
