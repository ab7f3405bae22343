"""The import rules of docs/architecture.md, checked by walking every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "arceus" / "v1"


def imported_modules(path: Path) -> set[str]:
    """Top-level and dotted names of every module `path` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.add(module)
    return names


def python_files(*parts: str) -> list[Path]:
    base = ROOT.joinpath(*parts)
    if base.is_file():
        return [base]
    return sorted(p for p in base.rglob("*.py") if GENERATED not in p.parents)


def violations(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in files:
        for module in imported_modules(path):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(ROOT)} imports {module}")
    return found


RULES = [
    (("controlplane",), ("nodeagent", "grpc")),
    (("tasks",), ("nodeagent",)),
    (("arceus",), ("django", "rest_framework", "controlplane", "tasks", "nodeagent")),
    (("nodeagent",), ("django", "rest_framework", "controlplane", "tasks")),
    (("nodeagent", "runtime.py"), ("grpc", "arceus.v1", "nodeagent.stage", "nodeagent.servicer")),
    (("arceus", "model"), ("grpc", "arceus.v1")),
    # Tensor-parallel compute sees only an injected all-reduce, never the transport that carries it.
    (("arceus", "model", "tensor_parallel.py"), ("grpc", "arceus.v1", "arceus.wire")),
    (("arceus", "pipeline"), ("grpc", "arceus.v1")),
    (("arceus", "wire", "codec.py"), ("grpc", "arceus.v1")),
    (("arceus", "wire", "compression.py"), ("grpc", "arceus.v1")),
    (("arceus", "wire", "transfer.py"), ("grpc", "arceus.v1")),
]


@pytest.mark.parametrize(("where", "forbidden"), RULES, ids=["/".join(w) for w, _ in RULES])
def test_import_rules(where: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    assert violations(python_files(*where), forbidden) == []


def test_the_walker_sees_imports() -> None:
    assert {"grpc", "arceus.v1"} <= imported_modules(ROOT / "nodeagent" / "servicer.py")
    assert "torch" in imported_modules(ROOT / "nodeagent" / "runtime.py")
