"""The CLI's own input errors: each names what is wrong and how to fix it, before any request."""

from __future__ import annotations

from pathlib import Path

import pytest

from arceus.cli import main


def test_missing_url_says_which_flag_or_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ARCEUS_URL", raising=False)
    with pytest.raises(SystemExit, match="pass --url or set ARCEUS_URL"):
        main(["--token", "t", "jobs", "list"])


def test_invalid_job_file_names_line_and_column(tmp_path: Path) -> None:
    spec = tmp_path / "job.json"
    spec.write_text('{"model_config": {"layer_sizes": [64, 10]},\n "epochs": }')
    with pytest.raises(SystemExit, match=r"job.json is not valid JSON \(line 2, column 12\)"):
        main(["--url", "http://127.0.0.1:9", "--token", "t", "jobs", "submit", str(spec)])


def test_job_file_must_be_an_object(tmp_path: Path) -> None:
    spec = tmp_path / "job.json"
    spec.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="must hold one JSON object"):
        main(["--url", "http://127.0.0.1:9", "--token", "t", "jobs", "submit", str(spec)])


def test_unreachable_control_plane_is_reported_not_raised(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--url", "http://127.0.0.1:9", "--token", "t", "jobs", "list"]) == 2
    assert "cannot reach the control plane at http://127.0.0.1:9" in capsys.readouterr().err
