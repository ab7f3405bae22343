"""Tenants' dataset files: named relative to the operator's data root, and confined to it.

The control plane passes the root in (its ARCEUS_DATA_ROOT setting); this module reads no settings. A name
that is absolute, climbs with `..`, resolves outside the root through a symlink, or is not a regular file
(a directory for MNIST) is refused with a SpecError naming the field and the rule."""

from __future__ import annotations

import stat
from pathlib import Path, PurePosixPath
from typing import Any

from arceus.data.config import MNIST_FILES, idx_file
from arceus.data.text_config import TEXT_DATASET
from arceus.errors import SpecError


def dataset_config_confined(cfg: Any, root: Path) -> Any:
    """`cfg` with a text `source` or an MNIST `path` replaced by the file (directory) it names under `root`,
    checked; anything else is returned as it is (validation proper comes after)."""
    if not isinstance(cfg, dict):
        return cfg
    name = str(cfg.get("name", "")).lower()
    if name == TEXT_DATASET and isinstance(cfg.get("source"), str) and cfg["source"]:
        return {**cfg, "source": str(_confined(root, cfg["source"], "dataset_config.source", directory=False))}
    if name == "mnist" and isinstance(cfg.get("path"), str) and cfg["path"]:
        directory = _confined(root, cfg["path"], "dataset_config.path", directory=True)
        for base in MNIST_FILES:
            found = idx_file(directory, base)
            if found is not None:
                _inside(root, found, "dataset_config.path", f"{cfg['path']}/{found.name}")
        return {**cfg, "path": str(directory)}
    return cfg


def _confined(root: Path, name: str, field: str, *, directory: bool) -> Path:
    rule = f"names a {'directory' if directory else 'file'} relative to the operator's data root"
    relative = PurePosixPath(name)
    if relative.is_absolute() or name.startswith("~") or Path(name).is_absolute():
        raise SpecError(field, f"must be a relative path: it {rule}, got {name!r}")
    if ".." in relative.parts:
        raise SpecError(field, f"may not contain '..': it {rule}, got {name!r}")
    resolved = _inside(root, root / relative, field, name)
    try:
        mode = resolved.stat().st_mode
    except OSError:
        raise SpecError(field, f"no {'directory' if directory else 'file'} {name!r} in the data root") from None
    if not (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)):
        raise SpecError(field, f"{name!r} is not a {'directory' if directory else 'regular file'}; it {rule}")
    return resolved


def _inside(root: Path, path: Path, field: str, name: str) -> Path:
    """`path` with its symlinks resolved, refused unless it stays under `root`."""
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise SpecError(field, f"{name!r} leads outside the data root (through a symbolic link); name a file in it")
    return resolved
