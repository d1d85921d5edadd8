"""Dagster's instance made ready for `pipeline-assets dev` and `dagster-env`, in a child process.

``cli/devserver.py`` runs ``python -m`` this module with DAGSTER_HOME (then model ids) as
arguments and the storage URL in the environment, so the long-lived `dev` process never
imports Dagster, nor builds a provider: the configured model's id (what the Dagster processes
read from the same environment) is added here. It creates Dagster's tables once (before the
webserver and daemon race to), empties the per-document scheme's dynamic partition set
``documents`` (an upgrade of an instance of that scheme; docs/dagster.md), and adds the model ids
missing from the ``model`` partition set, so the columns of ``embeddings`` exist before any sensor
ticks. Prints the number of legacy partitions deleted (0 once done).
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
        missing = [m for m in dict.fromkeys(model_keys or []) if m not in known and is_model_key(m)]
        if missing:
            instance.add_dynamic_partitions(MODEL_PARTITIONS_NAME, missing)
    finally:
        instance.dispose()
    return len(keys)


def configured_model_id() -> str:
    """The configured model's id, as the Dagster processes started with this environment see it."""
    from pipeline_assets.providers import model_id_for
    from pipeline_assets.settings import Settings

    return model_id_for(Settings.from_env().provider_config())


if __name__ == "__main__":
    print(setup(sys.argv[1], [*sys.argv[2:], configured_model_id()]), flush=True)
    sys.exit(0)
