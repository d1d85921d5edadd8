-- Sources other than a folder (content/source.py): the change token of the version of
-- each document that was ingested (a file's size and mtime, an object's ETag and size,
-- a row's version). Where the source's tokens vouch for the bytes (an ETag), an item
-- listed with the stored token is not read again.
ALTER TABLE app.documents ADD COLUMN source_token text;
