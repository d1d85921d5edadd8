"""Named points where a test can freeze a real worker process to kill it.

With PIPELINE_CRASHPOINT=<name> (``Settings.crashpoint``, read once at the
edge) the worker announces ``CRASHPOINT <name>`` on stderr when it reaches that
point and then blocks forever; the test kills the process with SIGKILL. Nothing
is simulated: the crash is a real dead process holding real leases. Unset (the
default), a crashpoint is a no-op.
"""

from __future__ import annotations

import sys
import time

AFTER_CLAIM = "after_claim"    # jobs leased, provider not yet called
AFTER_CALL = "after_call"      # provider answered (and billed), nothing committed


def reach(name: str, configured: str | None) -> None:
    """Freeze here if ``configured`` (the worker's crashpoint setting) names this point."""
    if configured != name:
        return
    sys.stderr.write(f"CRASHPOINT {name}\n")
    sys.stderr.flush()
    while True:
        time.sleep(3600)
