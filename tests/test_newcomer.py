"""What a newcomer meets first: the README's shape, `silod --version`, the license and the
changelog, and `silod simulate` with no arguments (the quick start) from any directory."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SILOD = [sys.executable, "-m", "scheduler"]


def test_version_is_the_package_metadata():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    proc = subprocess.run([*SILOD, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"silod {declared}"


def test_license_and_changelog_exist_and_match_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT"
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{project['version']}]" in changelog


def test_readme_is_short_starts_with_why_and_has_no_internal_history():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 260
    why = text.split("```", 1)[0].lower()  # what comes before the architecture picture
    assert all(word in why for word in ("gpu", "cache", "remote", "scheduler")), why
    assert text.splitlines().index("## Quick start") < 60, "the quick start belongs on the first screens"
    for pattern in (r"\bissue \d+", r"before (this|the) fix", r"#\d{2,}\b"):
        assert not re.search(pattern, text, re.IGNORECASE), pattern


def test_readme_and_docs_links_resolve():
    missing = []
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            if target.startswith("http") or (doc.parent / target).exists():
                continue
            missing.append(f"{doc.name} -> {target}")
    assert not missing, missing


def test_simulate_without_arguments_finds_the_shipped_trace(tmp_path):
    """The quick start runs `silod simulate` with no --trace: the shipped trace must be found
    wherever the command is run from and wherever the package's modules live."""
    proc = subprocess.run([*SILOD, "simulate", "--max-jobs", "3", "--quiet", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "summary.json").exists()
