-- Several active models, one served.
--
-- app.served_model has at most one row (its key can only be true): the model
-- `search` and `export` read. A switch is one UPDATE of that row, so there is
-- no moment without a served model and no moment with two. `models serve`
-- moves it only to a model whose vectors cover every current chunk (or with
-- --force). A model that is served cannot be retired or purged.
CREATE TABLE app.served_model (
    singleton         boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    model_id          text NOT NULL REFERENCES app.models,
    previous_model_id text REFERENCES app.models,
    served_at         timestamptz NOT NULL DEFAULT now()
);

-- retired_at: when `models retire` stopped new work for it; its vectors and its
-- index stay for the grace period (PIPELINE_MODEL_RETIRE_GRACE), then reconcile
-- deletes them and sets purged_at. `models activate` clears both.
ALTER TABLE app.models ADD COLUMN retired_at timestamptz, ADD COLUMN purged_at timestamptz;

-- Models retired before this migration: their grace period starts now.
UPDATE app.models SET retired_at = now() WHERE NOT active;

-- An existing database: serve the active model with the most vectors (until
-- now search used whichever model was configured; the one with the most
-- vectors is the one that was being served).
INSERT INTO app.served_model (model_id)
SELECT m.model_id FROM app.models m
WHERE m.active
ORDER BY (SELECT count(*) FROM app.embeddings e WHERE e.model_id = m.model_id) DESC, m.created_at DESC
LIMIT 1;
