"""An upload's rows read by byte range (arceus.data.upload_rows): any rows of a tensor file or of an uploaded text's
token file, in any order, come back as the driver's row-by-row reads give them, from few ranges; layouts and ranges
that are not what they must be are refused naming why."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from arceus.data.formats import inspect_file
from arceus.data.streaming import UploadRows, dataset_samples
from arceus.data.token_file import tokens_write
from arceus.data.upload_rows import (
    MAX_RANGE_BYTES,
    MAX_RANGES,
    MAX_READ_BYTES,
    ArrayLayout,
    SplitLayout,
    UploadLayout,
    layout_of,
    ranges_checked,
    row_ranges,
    rows_decoded,
    upload_layout,
)
from arceus.errors import SpecError

DATASET_ID = "5a79ccd5-d23d-4d42-9fc7-130ebee4706c"
N = 50


def tensor_file(fmt: str) -> bytes:
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(N, 3, 2, 2, generator=g), (torch.arange(N) % 7).to(torch.int32)
    if fmt == "safetensors":
        return save({"x": x, "y": y})
    out = io.BytesIO()
    np.savez(out, x=x.numpy(), y=y.numpy())
    return out.getvalue()


def read(data: bytes, ranges: list[tuple[int, int]]) -> list[bytes]:
    return [data[a:b] for a, b in ranges]


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.integers(0, N - 1), max_size=40))
def test_any_rows_come_back_as_the_drivers_reads_give_them(fmt: str, rows: list[int]) -> None:
    data = tensor_file(fmt)
    layout = upload_layout(DATASET_ID, io.BytesIO(data), len(data), fmt)
    cfg = {"name": "uploaded", "dataset_id": DATASET_ID, "kind": "tensors", "format": fmt}
    with dataset_samples(cfg, lambda _: io.BytesIO(data)) as splits:
        for samples, split in zip(splits, (layout.train, layout.validation), strict=True):
            rows_of(split, samples, [r % split.samples for r in rows], data)


def rows_of(split: SplitLayout, samples: UploadRows, rows: list[int], data: bytes) -> None:
    """`rows` of `split` read by range equal the driver's reads of them (`samples`), from one range per run."""
    for array, want in ((split.x, samples._x), (split.y, samples._y)):
        ranges = row_ranges(array, rows)
        got = rows_decoded(array, rows, ranges, read(data, ranges))
        handle = io.BytesIO(data)
        expected = [want.rows(handle, r, r + 1)[0] for r in rows]
        assert got.shape == (len(rows), *array.shape[1:])
        assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
        # Contiguous rows share a range: no more ranges than runs of rows.
        runs = sum(1 for i, r in enumerate(sorted(set(rows))) if i == 0 or r - 1 not in set(rows))
        assert len(ranges) == runs
        ranges_checked(ranges or [(array.offset, array.offset + 1)], [(array.offset, array.end)])


def token_file() -> tuple[bytes, dict]:
    """An uploaded text's token file (char vocabulary, as the control plane writes it) and its job's config."""
    text = "".join(f"{i} the quick brown fox\n" for i in range(120))
    cfg = {"name": "text", "dataset_id": DATASET_ID, "block_size": 8, "format": "text",
           **inspect_file(io.BytesIO(text.encode()), len(text.encode()), "text", "text")}
    out = io.BytesIO()
    tokens_write(cfg, io.BytesIO(text.encode()), out)
    return out.getvalue(), cfg


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.integers(0, 10_000), max_size=40))
def test_any_windows_of_a_token_file_come_back_as_the_drivers_reads_give_them(rows: list[int]) -> None:
    data, cfg = token_file()
    layout = layout_of(cfg, io.BytesIO(data), len(data))
    assert layout.kind == "text" and UploadLayout.from_json(layout.to_json()) == layout
    with dataset_samples(cfg, lambda _: io.BytesIO(data)) as splits:
        for samples, split in zip(splits, (layout.train, layout.validation), strict=True):
            rows_of(split, samples, [r % split.samples for r in rows], data)
            x, y = samples.take(torch.arange(len(samples)))
            assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(x[1:, 0], y[:-1, -1])  # the next tokens


def test_a_token_layout_whose_labels_are_not_the_next_tokens_is_refused() -> None:
    data, cfg = token_file()
    good = layout_of(cfg, io.BytesIO(data), len(data)).to_json()
    for change, field in ((dict(offset=good["train"]["x"]["offset"]), "data.layout_json.train.y"),
                          (dict(dtype="int32"), "data.layout_json.train.y"),
                          (dict(dtype="float32"), "data.layout_json.train.y.dtype")):
        with pytest.raises(SpecError) as caught:
            UploadLayout.from_json(split_changed(good, "train", "y", **change))
        assert caught.value.field == field


def test_a_long_run_of_rows_is_cut_into_bounded_ranges() -> None:
    array = ArrayLayout(100, "float32", (1 << 20, 64))  # 256 B rows: 32768 of them a range
    ranges = row_ranges(array, list(range(70_000)))
    assert len(ranges) == 3 and all(b - a <= MAX_RANGE_BYTES for a, b in ranges)
    assert ranges[0][0] == 100 and ranges[-1][1] == 100 + 70_000 * 256
    with pytest.raises(ValueError, match="not all among"):
        row_ranges(array, [1 << 20])


def test_an_answer_that_is_not_the_range_is_refused() -> None:
    array = ArrayLayout(0, "int64", (10,))
    ranges = row_ranges(array, [1, 2])
    with pytest.raises(ValueError, match="came back as 15 bytes"):
        rows_decoded(array, [1, 2], ranges, [b"\0" * 15])
    with pytest.raises(ValueError, match="0 answers for 1 ranges"):
        rows_decoded(array, [1, 2], ranges, [])


@pytest.mark.parametrize(("ranges", "message"), [
    ([], "names no range"),
    ([(0, 8)] * (MAX_RANGES + 1), f"at most {MAX_RANGES}"),
    ([(8, 8)], "is not 1 to"),
    ([(0, MAX_RANGE_BYTES + 1)], "is not 1 to"),
    ([(96, 104)], "outside the rows"),
    ([(200, 200 + MAX_RANGE_BYTES)] * (MAX_READ_BYTES // MAX_RANGE_BYTES + 1), "bytes; at most"),
])
def test_reads_are_bounded_and_inside_what_may_be_read(ranges: list[tuple[int, int]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ranges_checked(ranges, [(0, 100), (200, 200 + MAX_RANGE_BYTES)])


def good_layout() -> dict:
    data = tensor_file("safetensors")
    return upload_layout(DATASET_ID, io.BytesIO(data), len(data), "safetensors").to_json()


def split_changed(layout: dict, split: str, array: str, **change: object) -> dict:
    changed = json.loads(json.dumps(layout))
    changed[split][array].update(change)
    return changed


@pytest.mark.parametrize(("change", "field"), [
    (lambda g: {**g, "extra": 1}, "data.layout_json"),
    (lambda g: {**g, "dataset_id": "../other"}, "dataset_config.dataset_id"),
    (lambda g: {**g, "kind": "images"}, "data.layout_json.kind"),
    (lambda g: {**g, "size": -1}, "data.layout_json.size"),
    (lambda g: {**g, "train": {"x": g["train"]["x"]}}, "data.layout_json.train"),
    (lambda g: split_changed(g, "train", "x", shape=[0, 3, 2, 2]), "data.layout_json.train.x.shape"),
    (lambda g: split_changed(g, "train", "x", dtype="object"), "data.layout_json.train.x.dtype"),
    (lambda g: split_changed(g, "train", "x", shape=[45, 3, 4]), "data.layout_json.train.x.shape"),
    (lambda g: split_changed(g, "validation", "x", shape=[5, 3, 4, 1]), "data.layout_json.validation.x"),
    (lambda g: split_changed(g, "train", "y", dtype="float32"), "data.layout_json.train.y.dtype"),
    (lambda g: split_changed(g, "validation", "y", offset=10**9), "data.layout_json.validation.y"),
    (lambda g: split_changed(g, "train", "y", shape=[44]), "data.layout_json.train.y.shape"),
    (lambda g: split_changed(g, "validation", "y", offset=g["train"]["x"]["offset"] + 8), "data.layout_json"),
])
def test_a_layout_is_checked_whole(change: object, field: str) -> None:
    good = good_layout()
    assert UploadLayout.from_json(json.loads(json.dumps(good))).to_json() == good
    with pytest.raises(SpecError) as caught:
        UploadLayout.from_json(change(good))
    assert caught.value.field == field
