"""The layering of docs/architecture.md: the import-linter contracts in pyproject.toml hold, and no module
imports itself through others (no cycles between files, function-local and TYPE_CHECKING imports
included)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("arceus", "controlplane", "tasks", "nodeagent", "devtools")


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_the_import_linter_contracts_hold() -> None:
    result = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache", "--no-logo"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_no_module_imports_itself_through_others() -> None:
    assert import_cycles(grimp.build_graph(*PACKAGES)) == []


def test_the_cycle_finder_sees_a_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "cyclic"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from cyclic import b\n")
    (package / "b.py").write_text("def f():\n    from cyclic import c\n")  # a local import counts too
    (package / "c.py").write_text("import cyclic.a\n")
    (package / "d.py").write_text("import cyclic.a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles(grimp.build_graph("cyclic")) == [["cyclic.a", "cyclic.b", "cyclic.c"]]
