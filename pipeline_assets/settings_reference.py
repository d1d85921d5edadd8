"""The configuration table of docs/configuration.md, generated from the fields of ``Settings``
(``python -m pipeline_assets.settings_reference`` or ``pipeline-assets settings --reference``)."""

from __future__ import annotations

import dataclasses

from pipeline_assets.settings import Settings


def reference_table() -> str:
    """The README's configuration table, generated from the fields above."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(Settings):
        if f.name == "crashpoint":
            continue
        shown = f.metadata["shown_default"]
        if shown is None:
            default = f.default
            shown = "unset" if default is None else f"`{default}`"
        lines.append(f"| `{f.metadata['env']}` | {shown} | {f.metadata['doc']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_table())
