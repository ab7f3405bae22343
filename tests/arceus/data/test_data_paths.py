"""arceus.data.paths on its own (the API's tests are tests/controlplane/jobs/test_jobs_data_root.py): a name the
filesystem cannot take, such as one holding a NUL character, is a SpecError naming the field, never the OSError or
ValueError that the filesystem call would raise."""

from __future__ import annotations

from pathlib import Path

import pytest

from arceus.data.paths import dataset_config_confined
from arceus.errors import SpecError


@pytest.mark.parametrize(("cfg", "field"), [
    ({"name": "text", "source": "abcd\x00.txt"}, "dataset_config.source"),
    ({"name": "MNIST", "path": "mnist\x00"}, "dataset_config.path"),
])
def test_a_nul_character_is_a_spec_error_naming_the_field(tmp_path: Path, cfg: dict, field: str) -> None:
    (tmp_path / "abcd.txt").write_text("abcd", encoding="utf-8")
    (tmp_path / "mnist").mkdir()
    with pytest.raises(SpecError) as refused:
        dataset_config_confined(cfg, tmp_path)
    assert refused.value.field == field and "NUL character" in refused.value.message


def test_a_readable_file_is_taken_resolved(tmp_path: Path) -> None:
    (tmp_path / "abcd.txt").write_text("abcd", encoding="utf-8")
    assert dataset_config_confined({"name": "text", "source": "abcd.txt"}, tmp_path)["source"] == str(
        tmp_path / "abcd.txt"
    )
