from __future__ import annotations

import hashlib
import io
import json
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from arceus.checkpoint import (
    StateFile,
    checkpoint_digest,
    checkpoint_views,
    copy_stored,
    decode_checkpoint,
    encode_checkpoint,
)
from arceus.safetensors_file import (
    CHUNK_BYTES,
    CheckpointError,
    file_digest,
    header_handle,
    merged_checkpoint,
    sliced_checkpoint,
    tensor_layouts,
)


def tensors() -> dict[str, torch.Tensor]:
    return {
        "layers.0.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "layers.0.bias": torch.tensor([0.5, -1.5, 2.25]),
        "optimizer.layers.0.weight.step": torch.tensor(7.0),  # a 0-dim tensor, as Adam keeps its step
        "counts": torch.tensor([1, 2, 3], dtype=torch.int64),
    }


def header(data: bytes) -> dict:
    """The JSON header of a safetensors file: an 8-byte little-endian length, then the JSON."""
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length])


def test_round_trip_keeps_names_shapes_dtypes_and_values() -> None:
    original = tensors()
    decoded = decode_checkpoint(encode_checkpoint(original))
    assert set(decoded) == set(original)
    for name, tensor in original.items():
        assert decoded[name].dtype == tensor.dtype, name
        assert decoded[name].shape == tensor.shape, name
        assert torch.equal(decoded[name], tensor), name


def test_views_of_a_received_file_are_its_tensors_without_a_copy() -> None:
    original = {**tensors(), "empty": torch.zeros(0, 3)}
    data = bytearray(encode_checkpoint(original))
    views = checkpoint_views(data)
    assert set(views) == set(original)
    for name, tensor in original.items():
        assert views[name].dtype == tensor.dtype and views[name].shape == tensor.shape, name
        assert torch.equal(views[name], tensor), name
    (length,) = struct.unpack("<Q", data[:8])
    begin = 8 + length + header(bytes(data))["layers.0.bias"]["data_offsets"][0]
    data[begin : begin + 4] = struct.pack("<f", 9.0)  # a view sees a change of the buffer: it is no copy
    assert views["layers.0.bias"].tolist() == [9.0, -1.5, 2.25]


def test_reading_a_received_files_header_copies_no_tensor() -> None:
    """A joining replica's received state: its views and its header's layouts come without a second copy of it
    (io.BytesIO of a bytearray copied the whole file: a stage's state twice over, in the joiner's peak)."""
    data = bytearray(encode_checkpoint({"weight": torch.ones(2**20), "optimizer.weight.momentum": torch.ones(2**20)}))
    tracemalloc.start()
    try:
        views = checkpoint_views(data)
        layouts = tensor_layouts(header_handle(data), len(data))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert list(layouts) == ["optimizer.weight.momentum", "weight"] and views["weight"].sum() == 2**20
    assert peak < len(data) // 8, f"{peak:,} bytes allocated reading a {len(data):,}-byte file"


def test_non_contiguous_tensors_are_saved_by_value() -> None:
    transposed = torch.arange(6.0).reshape(2, 3).T
    assert not transposed.is_contiguous()
    decoded = decode_checkpoint(encode_checkpoint({"t": transposed}))
    assert torch.equal(decoded["t"], transposed)


def test_metadata_is_stored_in_the_header() -> None:
    data = encode_checkpoint(tensors(), metadata={"step": "40", "job_id": "j"})
    assert header(data)["__metadata__"] == {"step": "40", "job_id": "j"}
    assert "__metadata__" not in header(encode_checkpoint(tensors()))


def test_encoding_is_deterministic_so_the_hash_identifies_the_content() -> None:
    forward = tensors()
    backward = dict(reversed(list(forward.items())))
    assert encode_checkpoint(forward) == encode_checkpoint(backward)
    changed = {**forward, "layers.0.bias": torch.tensor([0.5, -1.5, 2.0])}
    assert checkpoint_digest(encode_checkpoint(changed)) != checkpoint_digest(encode_checkpoint(forward))


def test_digest_is_the_sha256_hex_of_the_bytes() -> None:
    data = encode_checkpoint(tensors())
    assert checkpoint_digest(data) == hashlib.sha256(data).hexdigest()


def test_the_expected_hash_is_checked_before_decoding() -> None:
    data = encode_checkpoint(tensors())
    digest = checkpoint_digest(data)
    assert torch.equal(decode_checkpoint(data, sha256=digest)["layers.0.bias"], tensors()["layers.0.bias"])
    # One changed byte in the tensor data still parses as safetensors; only the hash tells.
    tampered = data[:-1] + bytes([data[-1] ^ 0x01])
    decode_checkpoint(tampered)
    with pytest.raises(CheckpointError, match=f"expected {digest}: corrupt or replaced"):
        decode_checkpoint(tampered, sha256=digest)
    with pytest.raises(CheckpointError, match="expected 0{64}"):
        decode_checkpoint(data, sha256="0" * 64)


def pickled() -> bytes:
    buffer = io.BytesIO()
    torch.save(tensors(), buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"not a checkpoint", id="garbage"),
        pytest.param(encode_checkpoint(tensors())[:-3], id="truncated"),
        pytest.param(struct.pack("<Q", 5) + b"{nope", id="bad-json-header"),
        pytest.param(struct.pack("<Q", 100_000) + b"[" * 50_000 + b"]" * 50_000, id="header-nested-50000-deep"),
        pytest.param(pickled(), id="torch-pickle"),
    ],
)
def test_corrupt_bytes_are_a_checkpoint_error(data: bytes) -> None:
    with pytest.raises(CheckpointError, match="not a valid safetensors checkpoint"):
        decode_checkpoint(data)
    # With the right hash the content check passes, and the parse still fails cleanly.
    with pytest.raises(CheckpointError, match="not a valid safetensors checkpoint"):
        decode_checkpoint(data, sha256=checkpoint_digest(data))
    with pytest.raises(CheckpointError, match="not a valid safetensors checkpoint"):
        checkpoint_views(bytearray(data))



def test_merged_files_hold_the_kept_tensors_of_every_file_with_the_given_metadata() -> None:
    first = {**tensors(), "layers.0.bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16)}
    second = {"layers.1.weight": torch.ones(2, 5), "optimizer.layers.1.weight.exp_avg": torch.zeros(2, 5)}
    sources = [io.BytesIO(encode_checkpoint(first)), io.BytesIO(encode_checkpoint(second))]
    size, chunks = merged_checkpoint(sources, keep=lambda name: not name.startswith("optimizer."),
                                     metadata={"step": "9"})
    data = b"".join(chunks)
    assert len(data) == size
    merged = decode_checkpoint(data)
    expected = {n: t for n, t in {**first, **second}.items() if not n.startswith("optimizer.")}
    assert set(merged) == set(expected)
    for name, tensor in expected.items():
        assert merged[name].dtype == tensor.dtype and torch.equal(merged[name], tensor), name
    assert header(data)["__metadata__"] == {"step": "9"}
    assert (8 + struct.unpack("<Q", data[:8])[0]) % 8 == 0  # tensor data starts aligned


def test_merging_streams_a_chunk_at_a_time_whatever_the_files_size() -> None:
    big = {f"layers.{i}.weight": torch.full((1024, 1024, 5), float(i)) for i in range(4)}  # 80 MiB in all
    sources = [io.BytesIO(encode_checkpoint({name: t})) for name, t in big.items()]
    tracemalloc.start()
    try:
        size, chunks = merged_checkpoint(sources, keep=lambda name: True, metadata={})
        largest = 0
        for chunk in chunks:
            largest = max(largest, len(chunk))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert largest <= CHUNK_BYTES and size > 80 * 2**20
    assert peak < 3 * CHUNK_BYTES, f"merging held {peak:,} bytes at once"
    for source in sources:
        source.seek(0)
    _, chunks = merged_checkpoint(sources, keep=lambda name: True, metadata={})
    merged = decode_checkpoint(b"".join(chunks))
    assert all(torch.equal(merged[name], tensor) for name, tensor in big.items())


def test_a_file_that_is_no_safetensors_is_refused_with_the_reason() -> None:
    with pytest.raises(CheckpointError, match="header is no JSON"):
        merged_checkpoint([io.BytesIO(struct.pack("<Q", 4) + b"nope")], keep=lambda name: True, metadata={})
    assert file_digest(io.BytesIO(b"abc")) == hashlib.sha256(b"abc").hexdigest()


# --- a slice: some tensors of one file, renamed, read by range -----------------------------------------
def test_a_slice_is_the_file_safetensors_itself_saves_of_those_tensors_under_their_new_names() -> None:
    source = {f"model.layers.{i}.{p}": torch.randn(3, 5 + i) for i in range(4) for p in ("q", "k", "norm")}
    source["model.embed"] = torch.randn(7, 3)
    data = save(source, metadata={"format": "pt"})
    names = {f"layers.{i + 1}.{p}": f"model.layers.{i}.{p}" for i in (1, 2) for p in ("q", "k", "norm")}
    names["layers.9.tied"] = "model.embed"  # one source tensor may appear under any new name
    size, chunks = sliced_checkpoint(io.BytesIO(data), len(data), names)
    sliced = b"".join(chunks)
    assert len(sliced) == size
    assert sliced == save({new: source[old] for new, old in names.items()})
    metadata = {"format": "pt"}
    _, chunks = sliced_checkpoint(io.BytesIO(data), len(data), names, metadata=metadata)
    assert b"".join(chunks) == save({new: source[old] for new, old in names.items()}, metadata=metadata)


def test_a_slice_names_a_missing_tensor_and_refuses_a_source_that_is_not_what_its_header_says() -> None:
    data = save({"a": torch.ones(2), "b": torch.zeros(3)})
    with pytest.raises(CheckpointError, match="the weights lack c"):
        sliced_checkpoint(io.BytesIO(data), len(data), {"x": "c"})
    with pytest.raises(CheckpointError, match="tensors hold .* bytes of data, but the file carries"):
        sliced_checkpoint(io.BytesIO(data + b"\0" * 8), len(data) + 8, {"x": "a"})


def test_slicing_a_large_file_reads_it_by_range_a_chunk_at_a_time(tmp_path: Path) -> None:
    """A 300 MB file on disk (written without holding it), two thirds of it sliced: the slice's bytes are the
    source tensors' and the memory traced while streaming it stays a few chunks."""
    tensor_bytes, count = 10 * 2**20, 30
    offsets = [[i * tensor_bytes, (i + 1) * tensor_bytes] for i in range(count)]
    shape = [tensor_bytes // 4]
    layout = {f"t{i:02d}": {"dtype": "F32", "shape": shape, "data_offsets": at} for i, at in enumerate(offsets)}
    encoded = json.dumps(layout, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    path = tmp_path / "large.safetensors"
    with path.open("wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        for i in range(count):
            file.write(bytes([i]) * tensor_bytes)
    size = path.stat().st_size
    assert size > 300 * 10**6
    picked = {f"layers.{i:02d}.weight": f"t{i:02d}" for i in range(count) if i % 3}
    digest = hashlib.sha256()
    tracemalloc.start()
    try:
        with path.open("rb") as handle:
            length, chunks = sliced_checkpoint(handle, size, picked)
            prefix = next(chunks)
            for chunk in chunks:
                digest.update(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert length == len(prefix) + len(picked) * tensor_bytes and length > 200 * 2**20
    assert peak < 3 * CHUNK_BYTES, f"slicing held {peak:,} bytes at once (the file is {size:,})"
    expected = hashlib.sha256()
    for name in sorted(picked):
        expected.update(bytes([int(picked[name][1:])]) * tensor_bytes)
    assert digest.hexdigest() == expected.hexdigest()
    assert [n for n in header(prefix) if n != "__metadata__"] == sorted(picked)


# --- StateFile: a checkpoint read a tensor at a time ------------------------------------------------
STATE = {
    "layers.0.weight": torch.randn(3, 4),
    "layers.0.bias": torch.randn(3).to(torch.bfloat16),
    "optimizer.layers.0.weight.step": torch.tensor(7.0),
    "empty": torch.zeros(0, 5),
    "ids": torch.arange(6, dtype=torch.int64).view(2, 3),
}


def written(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "state.safetensors"
    path.write_bytes(data)
    return path


def test_a_state_file_reads_every_tensor_as_written_without_mapping_the_file(tmp_path: Path) -> None:
    data = encode_checkpoint(STATE)
    path = written(tmp_path, data)
    state = StateFile(path, sha256=checkpoint_digest(data))
    assert sorted(state) == sorted(STATE) and len(state) == len(STATE)
    assert state.shape_of("layers.0.weight") == [3, 4] and state.dtype_of("layers.0.bias") == torch.bfloat16
    for name, tensor in STATE.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)
    assert str(path) not in Path("/proc/self/maps").read_text()  # plain reads: no page of it counts as ours
    path.unlink()  # the agent's downloaded file goes as soon as it is open: the tensors stay readable
    torch.testing.assert_close(state["ids"], STATE["ids"])


def test_a_state_file_reads_a_tensor_into_the_place_given_and_refuses_another_layout(tmp_path: Path) -> None:
    state = StateFile(written(tmp_path, encode_checkpoint(STATE)))
    out = torch.full((2, 3), -1, dtype=torch.int64)
    pointer = out.data_ptr()
    state.read_into("ids", out)
    assert out.data_ptr() == pointer and torch.equal(out, STATE["ids"])
    for wrong in (torch.empty(3, 2, dtype=torch.int64), torch.empty(2, 3, dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"checkpoint tensor ids is I64 \[2, 3\]; cannot read it into"):
            state.read_into("ids", wrong)
    with pytest.raises(ValueError, match="only be read into a contiguous tensor"):
        state.read_into("ids", torch.empty(3, 2, dtype=torch.int64).t())


def test_copying_a_stored_tensor_reads_a_file_in_place_and_widens_or_copies_anything_else(tmp_path: Path) -> None:
    state = StateFile(written(tmp_path, encode_checkpoint(STATE)))
    weight = torch.zeros(3, 4)
    copy_stored(state, "layers.0.weight", weight)
    torch.testing.assert_close(weight, STATE["layers.0.weight"], rtol=0, atol=0)
    bias = torch.zeros(3)  # float32, stored as bfloat16: widened
    copy_stored(state, "layers.0.bias", bias)
    torch.testing.assert_close(bias, STATE["layers.0.bias"].float(), rtol=0, atol=0)
    views = checkpoint_views(bytearray(encode_checkpoint(STATE)))
    ids = torch.zeros(2, 3, dtype=torch.int64)
    copy_stored(views, "ids", ids)
    assert torch.equal(ids, STATE["ids"]) and ids.data_ptr() != views["ids"].data_ptr()


def test_a_state_file_that_is_not_what_its_header_says_is_refused(tmp_path: Path) -> None:
    data = encode_checkpoint(STATE)
    with pytest.raises(CheckpointError, match="content hash is"):
        StateFile(written(tmp_path, data), sha256="0" * 64)
    with pytest.raises(CheckpointError, match="bytes at offsets"):
        StateFile(written(tmp_path, data[:-8]))  # the last tensor's bytes run past the end of the file
    header_length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_length])
    for change, message in (
        ({"dtype": "X9"}, "is described as"),
        ({"shape": [3, -4]}, "has shape"),
        ({"data_offsets": [0, 4]}, "bytes at offsets"),
    ):
        bad = {**header, "layers.0.weight": {**header["layers.0.weight"], **change}}
        encoded = json.dumps(bad).encode()
        encoded += b" " * (-len(encoded) % 8)
        rewritten = len(encoded).to_bytes(8, "little") + encoded + data[8 + header_length :]
        with pytest.raises(CheckpointError, match=message):
            StateFile(written(tmp_path, rewritten))
