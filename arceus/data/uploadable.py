"""What a developer holds, as a file the control plane takes (`ArceusClient.upload_dataset`): a pair of tensors
`(x, y)`, a `torch.utils.data.Dataset` of `(x, y)` samples, or a file path (its format from its suffix).

A `Dataset` is written sample by sample into an uncompressed `.npz` (`x.npy`, `y.npy` streamed into the zip),
so one that does not fit in memory still converts; a pair already in memory is written as safetensors.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from arceus.data.formats import FORMATS

SUFFIX_FORMATS = {".txt": "text", ".text": "text", ".jsonl": "jsonl", ".parquet": "parquet",
                  ".safetensors": "safetensors", ".npz": "npz", ".json": "tokenizer"}


def uploadable(data: Any, directory: Path) -> tuple[Path, str]:
    """(file, format) for `data`; files it writes go under `directory` (the caller's to delete)."""
    if isinstance(data, str | Path):
        path = Path(data)
        fmt = SUFFIX_FORMATS.get(path.suffix.lower())
        if not path.is_file():
            raise ValueError(f"no file {path}")
        if fmt is None:
            raise ValueError(f"cannot tell {path}'s format from its suffix; one of {', '.join(SUFFIX_FORMATS)}")
        return path, fmt
    if isinstance(data, tuple | list) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        x, y = _pair(*data)
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} samples but y {len(y)}; one label per sample")
        path = directory / "dataset.safetensors"
        save_file({"x": x, "y": y}, str(path))
        return path, "safetensors"
    if isinstance(data, torch.utils.data.Dataset):
        return _dataset_npz(data, directory / "dataset.npz"), "npz"
    raise TypeError(
        f"cannot upload a {type(data).__name__}: pass (x, y) tensors, a torch Dataset of (x, y) samples or a file "
        f"path (formats: {', '.join(FORMATS)})"
    )


def _pair(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().to("cpu", torch.float32).contiguous()
    if y.dtype.is_floating_point:
        raise ValueError(f"y is {y.dtype}; labels are integer class indices")
    return (x.reshape(len(x), -1) if x.dim() not in (2, 4) else x), y.detach().to("cpu", torch.int64).contiguous()


def _dataset_npz(dataset: torch.utils.data.Dataset, path: Path) -> Path:
    n = len(dataset)  # type: ignore[arg-type]
    if n < 2:
        raise ValueError(f"the dataset has {n} samples; training and validation need at least one each")
    first_x, _ = _pair(*(t.unsqueeze(0) for t in _sample(dataset, 0)))
    shape = tuple(first_x.shape[1:])
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, dtype, row in (("x", np.float32, shape), ("y", np.int64, ())):
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
                      "shape": (n, *row)}
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array_header_2_0(member, header)
                for i in range(n):
                    x, y = _pair(*(t.unsqueeze(0) for t in _sample(dataset, i)))
                    value = x if name == "x" else y
                    if name == "x" and tuple(value.shape[1:]) != shape:
                        raise ValueError(f"sample {i}'s x has shape {list(value.shape[1:])}, sample 0's {list(shape)}")
                    member.write(value.numpy().tobytes())
    return path


def _sample(dataset: torch.utils.data.Dataset, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    item = dataset[index]
    if not (isinstance(item, tuple | list) and len(item) == 2):
        raise ValueError(f"sample {index} is a {type(item).__name__}; each sample must be an (x, y) pair")
    x, y = (torch.as_tensor(t) for t in item)
    return x, y
