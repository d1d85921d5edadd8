"""Dagster's instance made ready for `pipeline-assets dev` and `dagster-env`, in a child process.

``devserver.prepare`` runs this module as ``python -m`` with DAGSTER_HOME as
its argument and the storage URL in the environment (Dagster's instance
config reads it), so the long-lived `pipeline-assets dev`
process never imports Dagster (about 70 MB it would hold for the whole
session, beside the webserver, daemon and code server that need it):

* Dagster's tables are created once, before the webserver and the daemon race
  to create them;
* the per-document scheme's dynamic partition set (``documents``) is emptied:
  its keys are no partitions of anything now (nothing is re-embedded).

Prints the number of legacy partitions deleted (0 once done) on stdout.
"""

import sys

LEGACY_PARTITIONS_NAME = "documents"


def setup(dagster_home: str) -> int:
    from dagster import DagsterInstance

    instance = DagsterInstance.from_config(dagster_home)
    try:
        keys = instance.get_dynamic_partitions(LEGACY_PARTITIONS_NAME)
        for key in keys:
            instance.delete_dynamic_partition(LEGACY_PARTITIONS_NAME, key)
    finally:
        instance.dispose()
    return len(keys)


if __name__ == "__main__":
    print(setup(sys.argv[1]), flush=True)
    sys.exit(0)
