"""The command line: parse, call a use case in ``pipeline_assets.app``, print.

Settings are read from the environment once, by the root group, and passed down.
Expected failures print one line (``error: ...``) and exit 1; nothing here holds
logic the Dagster layer would need. One module per command family.
"""

from pipeline_assets.cli.root import main

__all__ = ["main"]
