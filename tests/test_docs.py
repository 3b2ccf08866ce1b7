"""The README and docs (issue 30): short, every relative link resolves, the picture builds from its source."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from agentsandbox import PURPOSE
from agentsandbox.cli import usage
from agentsandbox.config import ProxyConfig, SandboxConfig
from tests.conftest import REPO

DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
#: A Markdown link or image: [text](target) / ![alt](target).
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text)))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # an absolute URL: not ours to check offline
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_every_doc_page_is_linked_from_the_readme_or_a_page_it_links() -> None:
    readme = (REPO / "README.md").read_text()
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(readme)}
    for page in DOCS.glob("*.md"):
        linked |= {Path(t.partition("#")[0]).name for t in LINK.findall(page.read_text()) if page.name in linked}
    assert {p.name for p in DOCS.glob("*.md")} <= linked


def test_the_readme_is_short_and_its_first_screen_says_what_how_and_shows_the_picture() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    first = "\n".join(lines[:60])
    assert lines[2] == PURPOSE
    for needed in ("![", "docs/enforcement.svg", "## Install", "apt install", "nixosModules",
                   "homeManagerModules", "pip install", "sudo scripts/demo", "sudo scripts/test"):
        assert needed in first, needed


def test_help_and_every_man_page_open_with_the_readmes_purpose() -> None:
    assert usage().splitlines()[2] == PURPOSE
    for page in sorted((REPO / "debian").glob("*.1")):
        text = page.read_text()
        description = text.split(".SH DESCRIPTION\n", 1)[1].splitlines()[0]
        assert description == PURPOSE, page.name


def test_the_picture_names_only_files_and_keys_the_code_has() -> None:
    source = (DOCS / "enforcement.dot").read_text().replace("\\n", " ")  # a label's line breaks
    files = set(re.findall(r"agentsandbox/[\w/]+\.py", source))
    assert files, "the picture names the modules that enforce"
    for name in files:
        assert (REPO / name).is_file(), name
    for table, fields in (("sandbox", SandboxConfig.__dataclass_fields__), ("proxy", ProxyConfig.__dataclass_fields__)):
        keys = set(re.findall(rf"(?<![\w/-]){table}\.(\w+)", source))
        assert keys and keys <= set(fields), (table, keys - set(fields))


def test_the_picture_builds_from_its_source_and_is_current(tmp_path: Path) -> None:
    dot = shutil.which("dot")
    if dot is None:
        pytest.fail("Graphviz's dot is not installed (.ci/install-deps installs graphviz)")
    out = tmp_path / "enforcement.svg"
    subprocess.run([dot, "-Tsvg", str(DOCS / "enforcement.dot"), "-o", str(out)], check=True, timeout=60)
    built = out.read_text()
    assert "<svg" in built and "PreToolUse hook" in built
    assert built == (DOCS / "enforcement.svg").read_text(), (
        "docs/enforcement.svg is stale: dot -Tsvg docs/enforcement.dot -o docs/enforcement.svg"
    )
