"""The documentation site (mkdocs.yml): it builds strictly, its API reference covers the public surface, and a link
to a file the checkout lacks fails the build (ci/docs_links.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]') builds the site")


def _build(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def _copy(tmp_path: Path) -> Path:
    """The checkout, copied without its environments, git data and built site."""
    root = tmp_path / "repo"
    heavy = shutil.ignore_patterns(".git", ".venv*", "site", "__pycache__", "*.egg-info", ".*_cache")
    shutil.copytree(ROOT, root, ignore=heavy)
    return root


def test_the_site_builds_strictly_with_an_api_reference(tmp_path):
    root = _copy(tmp_path)
    built = _build(root, tmp_path / "site")
    assert built.returncode == 0, built.stderr[-3000:]
    pages = ("api", "features", "backends")
    reference = {page: (tmp_path / "site" / "reference" / f"{page}.html").read_text() for page in pages}
    expected = [
        ("api", "dropbp.apply"),
        ("api", "dropbp.controller.DropBPController"),
        ("api", "dropbp.integrations.hf.DropBPCallback"),
        ("features", "dropbp.NoiseScale"),
        ("features", "dropbp.features.base.Feature"),
        ("backends", "backends.base.Backend"),
    ]
    for page, anchor in expected:
        assert f'id="{anchor}"' in reference[page], f"the API reference lacks {anchor} on {page}.html"
    assert "Attach DropBP to" in reference["api"]  # apply's docstring, rendered


def test_every_page_is_in_the_site_navigation():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, dict):
            for value in node.values():
                yield from pages(value)
        elif isinstance(node, list):
            for value in node:
                yield from pages(value)

    in_nav = set(pages(config["nav"]))
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == in_nav


def test_a_link_to_a_missing_file_fails_the_build(tmp_path):
    root = _copy(tmp_path)
    page = root / "docs" / "demo.md"
    page.write_text(page.read_text() + "\nSee [the record](../benchmarks/results/no_such_record.md).\n")
    built = _build(root, tmp_path / "site")
    assert built.returncode != 0
    said = "demo.md links to ../benchmarks/results/no_such_record.md, which is not a file of this checkout"
    assert said in built.stderr
