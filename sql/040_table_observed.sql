-- The digest of a table source (rows, bit_xor of row versions: store/table_source.py)
-- when the source sensor last observed all of it, taken before and after that complete
-- listing and stored only when both agree. While the table's digest is still this one,
-- the observations hold: a tick (or a bucket run's scan) lists nothing.
CREATE TABLE app.table_observed (
    source      text PRIMARY KEY,   -- the canonical source string (app.source_observations.root)
    rows        bigint NOT NULL,
    digest      bigint NOT NULL,
    observed_at timestamptz NOT NULL DEFAULT now()
);
