"""Nothing in the product assumes one host.

Every loopback address (127.0.0.1, localhost, ::1) in the shipped code, SQL and deployment
files is listed below with why it is not a single-host assumption: a default of a server a
person starts on their own machine (overridable by an option), or the webserver published on
the Docker host's loopback for a proxy on that host. A new one fails this test until it is
made a setting or an option, or added here with its reason.
"""

from __future__ import annotations

import re

from pipeline_assets_tests.processes import REPO

LOOPBACK = re.compile(r"127\.0\.0\.1|\blocalhost\b|\[::1\]|(?<![\w:])::1\b")
SCANNED = ("pipeline_assets/**/*.py", "sql/**/*.sql", "deploy/**/*", "dagster.yaml", "workspace.yaml")

# (file, the line's text without surrounding space) -> why it is legitimate.
ALLOWED = {
    (
        "pipeline_assets/app/metrics.py",
        'def serve(self, port: int, host: str = "127.0.0.1") -> tuple[str, int]:',
    ): "a default: `work --metrics-host` passes the address (0.0.0.0 in compose and k8s)",
    (
        "pipeline_assets/cli/pipeline.py",
        '@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="Address the metrics '
        'server binds.")',
    ): "a default of an option: the metrics server is private unless told otherwise (it has no auth)",
    (
        "pipeline_assets/cli/server.py",
        '@click.option("--host", default="127.0.0.1", show_default=True)',
    ): "`dev --host`: the one-machine Dagster UI of a developer",
    (
        "pipeline_assets/cli/devserver.py",
        'def run_dev(settings: Settings | None = None, host: str = "127.0.0.1", port: int = 3000) -> int:',
    ): "the default of `dev`'s host, passed by its --host option",
    (
        "deploy/compose.yaml",
        '- "127.0.0.1:3000:3000"   # no authentication in Dagster OSS: publish behind a proxy that has it',
    ): "the webserver published on the Docker host's loopback for a proxy there (it has no authentication)",
}


def _occurrences() -> set[tuple[str, str]]:
    found = set()
    for pattern in SCANNED:
        for path in sorted(REPO.glob(pattern)):
            if not path.is_file() or "__pycache__" in path.parts or path.suffix in (".pyc", ".onnx"):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            for line in text.splitlines():
                if LOOPBACK.search(line):
                    found.add((str(path.relative_to(REPO)), line.strip()))
    return found


def test_the_pattern_finds_loopback_addresses():
    for text in ("host='127.0.0.1'", "http://localhost:3000", "[::1]:5432", "bind ::1"):
        assert LOOPBACK.search(text), text
    for text in ("localhost_name", "a::10", "std::1x"):
        assert not LOOPBACK.search(text), text


def test_no_loopback_address_outside_the_listed_defaults():
    found = _occurrences()
    unexpected = sorted(found - set(ALLOWED))
    assert not unexpected, (
        "a loopback address that would break on several hosts (make it a setting or "
        "an option, or list it with its reason):\n" + "\n".join(map(str, unexpected))
    )
    stale = sorted(set(ALLOWED) - found)
    assert not stale, f"listed but gone (drop them from ALLOWED): {stale}"
