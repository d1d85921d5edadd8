"""Named points where a test can freeze a real worker process to kill it.

With PIPELINE_CRASHPOINT=<name> (``Settings.crashpoint``, read once at the
edge) the worker announces ``CRASHPOINT <name>`` on stderr when it reaches that
point and then blocks forever; the test kills the process with SIGKILL. Nothing
is simulated: the crash is a real dead process holding real leases. Unset (the
default), a crashpoint is a no-op. ``<name>:<marker>`` freezes only a request
carrying an input that contains ``marker``: an input that crashes its worker
(the poison that OOMs the process). ``log_unconsumed`` freezes a table source's
ingest between committing the logged rows' documents and deleting their entries.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable

AFTER_CLAIM = "after_claim"  # jobs leased, provider not yet called
AFTER_CALL = "after_call"  # provider answered (and billed), nothing committed
LOG_UNCONSUMED = "log_unconsumed"  # a table's logged rows ingested and committed, the entries not yet deleted


def reach(name: str, configured: str | None, texts: Iterable[str | None] = ()) -> None:
    """Freeze here if ``configured`` (the worker's crashpoint setting) names this point
    (and, with a marker, one of the request's ``texts`` contains it; read only then)."""
    if configured is None:
        return
    point, _, marker = configured.partition(":")
    if point != name or (marker and not any(marker in (t or "") for t in texts)):
        return
    sys.stderr.write(f"CRASHPOINT {name}\n")
    sys.stderr.flush()
    while True:
        time.sleep(3600)
