"""JobProgressBar: the CLI's and the demo's live bar, drawn from a job's API detail."""

from __future__ import annotations

import io
import re

from arceus.progress_bar import JobProgressBar

DETAIL = {"id": "650616c4-afdc-4c82-88f1-d43a6083a0e2", "total_steps": 450, "epochs_requested": 10, "epoch": 1}


def test_steps_done_before_the_bar_existed_are_not_counted_in_its_rate() -> None:
    out = io.StringIO()
    bar = JobProgressBar(file=out)
    bar.update({**DETAIL, "total_steps": None})  # not placed yet: no bar
    assert out.getvalue() == ""
    bar.update({**DETAIL, "step": 29, "last_loss": 2.0771, "samples_per_second": 1383.4})
    first = re.split(r"[\r\n]", out.getvalue().rstrip())[-1]  # what the terminal shows now
    assert "job 650616c4" in first and "29/450" in first and "loss=2.0771" in first and "samples/s=1383" in first
    assert "?step/s" in first  # no rate from 29 steps "done" in the bar's first microseconds
    bar.update({**DETAIL, "step": 58, "epoch": 2, "val_accuracy": 0.9123})
    bar.close()
    last = re.split(r"[\r\n]", out.getvalue().rstrip())[-1]
    assert "58/450" in last and "epoch=2/10" in last and "val_acc=0.912" in last
