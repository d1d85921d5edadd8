-- Answers in a row that the provider made but that held nothing usable, even
-- to a single trivial input (a wrong count of vectors, a duplicate or missing
-- index): counted here, shared by every worker and kept across restarts, so
-- that the stop after decisions.MAX_UNMATCHED_ANSWERS of them survives a
-- restart policy (a restarted worker asks one trivial input before it claims
-- anything). Any usable answer resets it. A constant default: no table rewrite.
ALTER TABLE app.provider_state
    ADD COLUMN unusable_answers int NOT NULL DEFAULT 0;
