"""Tenants' dataset files: named relative to the operator's data root, and confined to it.

The control plane passes the root in (its ARCEUS_DATA_ROOT setting); this module reads no settings. A name
that holds a NUL character, is absolute or climbs with `..` is refused with a SpecError naming the field and the
rule. Every other name the tenant may not read (missing, resolving outside the root through a symlink, not a
regular file (a directory for MNIST), unreadable) gets one and the same refusal, so that refusals do not tell a
tenant which files exist in the root or beside it."""

from __future__ import annotations

import os
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
                _readable(root, found, "dataset_config.path", f"{cfg['path']}/{found.name}", directory=False)
        return {**cfg, "path": str(directory)}
    return cfg


def _confined(root: Path, name: str, field: str, *, directory: bool) -> Path:
    rule = f"names a {'directory' if directory else 'file'} relative to the operator's data root"
    if "\x00" in name:
        raise SpecError(field, f"contains a NUL character: it {rule}, got {name!r}")
    relative = PurePosixPath(name)
    if relative.is_absolute() or name.startswith("~") or Path(name).is_absolute():
        raise SpecError(field, f"must be a relative path: it {rule}, got {name!r}")
    if ".." in relative.parts:
        raise SpecError(field, f"may not contain '..': it {rule}, got {name!r}")
    return _readable(root, root / relative, field, name, directory=directory)


def _readable(root: Path, path: Path, field: str, name: str, *, directory: bool) -> Path:
    """`path` with its symlinks resolved, once it is a readable regular file (a directory) under `root`; the one
    refusal otherwise, whatever the reason."""
    kind = "directory" if directory else "file"
    try:
        resolved = path.resolve()
        mode = resolved.stat().st_mode
    except (OSError, RuntimeError):  # missing, not ours to look at, or a symlink loop (RuntimeError)
        resolved, mode = path, 0
    readable = (stat.S_ISDIR(mode) and os.access(resolved, os.R_OK | os.X_OK) if directory
                else stat.S_ISREG(mode) and os.access(resolved, os.R_OK))
    if not readable or not resolved.is_relative_to(root.resolve()):
        raise SpecError(field, f"no readable {kind} {name!r} in the data root: name a {kind} under it")
    return resolved
