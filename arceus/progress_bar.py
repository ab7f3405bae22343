"""A live terminal progress bar for a job, fed from its API detail (used by the CLI and the demo)."""

from __future__ import annotations

from typing import Any, TextIO

from tqdm import tqdm


class JobProgressBar:
    def __init__(self, *, file: TextIO | None = None) -> None:
        self._bar: tqdm | None = None
        self._file = file

    def update(self, detail: dict[str, Any]) -> None:
        total = detail.get("total_steps") or None
        step = int(detail.get("step") or 0)
        if self._bar is None:
            if total is None:
                return  # not placed yet: nothing to draw a bar against
            # Counted from the first step seen: steps done before the bar existed (a job watched mid-way, or a
            # burst between two polls) would otherwise read as done in no time (hundreds of thousands a second).
            self._bar = tqdm(total=total, initial=step, unit="step", file=self._file, dynamic_ncols=True,
                             desc=f"job {str(detail['id'])[:8]}")
        else:
            self._bar.update(step - self._bar.n)
        postfix = {"epoch": f"{detail.get('epoch') or 0}/{detail.get('epochs_requested')}"}
        if detail.get("last_loss") is not None:
            postfix["loss"] = f"{detail['last_loss']:.4f}"
        if detail.get("samples_per_second"):
            postfix["samples/s"] = f"{detail['samples_per_second']:.0f}"
        if detail.get("val_accuracy") is not None:
            postfix["val_acc"] = f"{detail['val_accuracy']:.3f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
