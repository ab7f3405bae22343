"""docs/architecture.md's concept table stays true: every file or folder it names exists, and every package of
the system is somewhere in it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SOURCE_ROOTS = ("arceus", "controlplane", "nodeagent", "tasks", "devtools")
TOP_LEVEL = {p.name for p in ROOT.iterdir()}


def concept_table_paths() -> list[str]:
    """The paths in the right column of the table under "Where each concept lives"."""
    section = DOC.read_text(encoding="utf-8").split("## Where each concept lives", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and line.count("|") >= 3]
    paths: list[str] = []
    for row in rows:
        owner = row.rstrip().rstrip("|").rsplit("|", 1)[1]
        # Names are relative to the row's last full path: `arceus/model/<type>/`: `mlp/`, `gpt/` (`parallel.py`)
        # names arceus/model/gpt/parallel.py; names with no extension or trailing slash are symbols, not files.
        base = context = ""
        for name in re.findall(r"`([\w./<>-]+)`", owner):
            if not (name.endswith("/") or re.search(r"\.\w+$", name)):
                continue
            if name.split("/", 1)[0] in TOP_LEVEL:
                path = name
                base = context = name.split("<", 1)[0] if name.endswith("/") else name.rsplit("/", 1)[0] + "/"
            elif name.endswith("/") and "/" not in name.rstrip("/"):
                path = context = base + name
            else:
                path = context + name
            paths.append(path)
    return paths


def test_every_path_the_concept_table_names_exists() -> None:
    paths = [p for p in concept_table_paths() if "<" not in p]
    assert len(paths) > 100  # the table was read, not an empty match
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_every_package_is_in_the_concept_table() -> None:
    named = concept_table_paths()
    packages = sorted(
        str(init.parent.relative_to(ROOT)) + "/"
        for source in SOURCE_ROOTS
        for init in (ROOT / source).rglob("__init__.py")
        if "v1" not in init.parts and "migrations" not in init.parts and "templatetags" not in init.parts
    )
    unnamed = [p for p in packages if not any(n.startswith(p) for n in named)]
    assert not unnamed, f"packages with no row in docs/architecture.md's concept table: {unnamed}"
