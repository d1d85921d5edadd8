"""Dagster's instance made ready for `pipeline-assets dev` and `dagster-env`, in a child process.

``cli/devserver.py`` (``prepare``) runs this module as ``python -m`` with DAGSTER_HOME as
its argument and the storage URL in the environment (Dagster's instance
config reads it), so the long-lived `pipeline-assets dev`
process never imports Dagster (about 70 MB it would hold for the whole
session, beside the webserver, daemon and code server that need it):

* Dagster's tables are created once, before the webserver and the daemon race
  to create them;
* the per-document scheme's dynamic partition set (``documents``) is emptied:
  its keys are no partitions of anything now (nothing is re-embedded);
* the model ids given after DAGSTER_HOME (the registry's active models and the
  configured one) are added to the ``model`` partition set if missing: the
  columns of ``embeddings`` exist before any sensor ticks, also on an instance
  of the bucket-only scheme (whose ``embeddings`` materializations keep their
  bucket keys: history, not partitions of the new definition).

Prints the number of legacy partitions deleted (0 once done) on stdout.
"""

import sys

LEGACY_PARTITIONS_NAME = "documents"


def setup(dagster_home: str, model_keys: list[str] | None = None) -> int:
    from dagster import DagsterInstance

    from pipeline_assets.defs.partitions import MODEL_PARTITIONS_NAME, is_model_key

    instance = DagsterInstance.from_config(dagster_home)
    try:
        keys = instance.get_dynamic_partitions(LEGACY_PARTITIONS_NAME)
        for key in keys:
            instance.delete_dynamic_partition(LEGACY_PARTITIONS_NAME, key)
        known = set(instance.get_dynamic_partitions(MODEL_PARTITIONS_NAME))
        missing = [m for m in model_keys or [] if m not in known and is_model_key(m)]
        if missing:
            instance.add_dynamic_partitions(MODEL_PARTITIONS_NAME, missing)
    finally:
        instance.dispose()
    return len(keys)


if __name__ == "__main__":
    print(setup(sys.argv[1], sys.argv[2:]), flush=True)
    sys.exit(0)
