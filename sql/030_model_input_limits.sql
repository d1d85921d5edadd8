-- Per-model input windows: max_input_tokens is the window in the
-- model's own tokens; max_chunk_tokens the largest chunk (in the chunker's
-- cl100k tokens) that fits it; tokenizer what the window is counted in.
-- Rows registered before this migration were all counted in cl100k tokens.
ALTER TABLE app.models
    ADD COLUMN max_chunk_tokens int,
    ADD COLUMN tokenizer text NOT NULL DEFAULT 'cl100k';
UPDATE app.models SET max_chunk_tokens = max_input_tokens WHERE max_chunk_tokens IS NULL;
