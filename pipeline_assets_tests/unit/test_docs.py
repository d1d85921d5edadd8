"""The documentation, checked: the README stays short and keeps the two one-line commands (the
main job on the bundled example, the tests), every relative link in README.md, docs/*.md and
benchmarks/README.md points at a file that exists (and at a heading that exists, for `#anchor`
links into Markdown), and docs/commands.md documents every command and option of the CLI.

No database: these read files and the click command tree only.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import click

from pipeline_assets.cli.root import main as cli_main

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md")), REPO / "benchmarks" / "README.md"]
MAX_README_LINES = 300

LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _without_code_spans(line: str) -> str:
    return re.sub(r"`[^`]*`", "", line)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link keeps its text
    text = text.replace("`", "").lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text(encoding="utf-8")):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    found = []
    for line in _prose(page.read_text(encoding="utf-8")):
        found += LINK.findall(_without_code_spans(line))
    return found


def test_the_anchor_rule_matches_github():
    assert _slug("Walk-through: a parser fix") == "walk-through-a-parser-fix"
    assert _slug("What an `embeddings` run waits for") == "what-an-embeddings-run-waits-for"
    assert _slug("B5 memory as the corpus grows 10×") == "b5-memory-as-the-corpus-grows-10"
    assert _slug("Dagster's own commands") == "dagsters-own-commands"


def test_every_relative_link_points_at_something_that_exists():
    broken = []
    for page in PAGES:
        for target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(REPO)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where}: no heading with that anchor in {dest.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(REPO / t.partition("#")[0]).resolve() for t in links(README) if not t.startswith("http")}
    missing = [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_the_readme_is_short_and_keeps_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_README_LINES, "the README is for a five-minute read: move detail to docs/"
    quick = text.split("## Quick start", 1)[1].split("```", 2)[1]
    commands = [line.split("#", 1)[0].strip() for line in quick.splitlines() if line.strip()]
    assert "pipeline-assets embed examples/corpus" in commands  # the main job, no key, no server
    assert "pytest -q" in commands  # the tests, exactly what CI runs
    assert (REPO / ".ci" / "run").read_text().rstrip().endswith("pytest -q")


def _commands(group: click.Group, prefix: str = "") -> list[tuple[str, click.Command]]:
    out = []
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, name
        path = f"{prefix}{name}"
        out.append((path, command))
        if isinstance(command, click.Group):
            out += _commands(command, f"{path} ")
    return out


def _sections(page: str) -> dict[str, str]:
    """The text under each `## name` heading of docs/commands.md."""
    parts = re.split(r"^## +(.+?)\s*$", page, flags=re.M)
    return {name.strip(): body for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def test_docs_commands_documents_every_command_and_option():
    """Each command has a `## top-level-name` section naming it and every one of its options."""
    page = (DOCS / "commands.md").read_text(encoding="utf-8")
    sections = _sections(page)
    problems = []
    for path, command in _commands(cli_main):
        if isinstance(command, click.Group):
            continue
        section = sections.get(path.split()[0])
        if section is None:
            problems.append(f"docs/commands.md has no section `## {path.split()[0]}`")
            continue
        if f"`{path}" not in section and f"`pipeline-assets {path}" not in section:
            problems.append(f"command `{path}` is not in its section of docs/commands.md")
        for param in command.params:
            for opt in getattr(param, "opts", []):
                if opt.startswith("-") and opt != "--help" and not re.search(rf"{re.escape(opt)}\b", section):
                    problems.append(f"`{path} {opt}` is not in its section of docs/commands.md")
    for param in cli_main.params:
        for opt in param.opts:
            if opt not in page:
                problems.append(f"global option {opt} is not in docs/commands.md")
    assert not problems, "\n".join(problems)
