#!/usr/bin/env bash
# Run every benchmark once at full size, one after the other (they would
# disturb each other if run together). Each prints one JSON object on stdout;
# progress goes to stderr. Takes about 6-8 minutes on a 2-core machine.
#
#   bash benchmarks/run_all.sh > results.jsonl
#
# Needs the project installed with its bench extra: pip install -e ".[bench]"
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"

if ! "$PYTHON" -c "import pgqueuer, asyncpg" 2>/dev/null; then
    echo "note: pgqueuer/asyncpg missing (pip install -e '.[bench]'); B1 will report the error" >&2
fi

status=0
for bench in b1_core b1_cli_sdk b2_provider b3_rerun b4_reconcile b5_memory b6_export b7_scale_out b8_source_sensor \
             b9_partition_backlog b10_dagster_scale b12_bucket_run_memory; do
    echo "== $bench" >&2
    "$PYTHON" "benchmarks/$bench.py" | "$PYTHON" -c 'import json, sys; print(json.dumps(json.load(sys.stdin)))' \
        || { echo "$bench failed" >&2; status=1; }
done
exit $status
