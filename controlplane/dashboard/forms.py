"""The dashboard's forms: they turn a browser's fields into the API's input shapes, which validate them
(JobSubmitInput, NodeControlsInput), so a page accepts exactly what the API does."""

from __future__ import annotations

import json
import re
from typing import Any

from django import forms

from arceus.errors import SpecError
from arceus.json_input import json_loads_bounded
from controlplane.jobs.models import PipelineSchedule

MAX_JSON_CHARS = 20_000
EXAMPLE_MODEL = {"type": "mlp", "layer_sizes": [64, 128, 64, 10]}
EXAMPLE_DATASET = {"name": "digits", "batch_size": 32, "val_batch_size": 360}


class JsonObjectField(forms.CharField):
    """A JSON object typed into a text area."""

    widget = forms.Textarea(attrs={"rows": 3, "cols": 60, "spellcheck": "false"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_length=MAX_JSON_CHARS, **kwargs)

    def to_python(self, value: Any) -> Any:
        text = super().to_python(value)
        if not text and not self.required:
            return None
        if len(text) > MAX_JSON_CHARS:  # before parsing: the length validator runs after to_python
            raise forms.ValidationError(f"has {len(text)} characters; at most {MAX_JSON_CHARS} are accepted")
        try:
            parsed = json_loads_bounded(text, where="")
        except SpecError as exc:
            raise forms.ValidationError(f"{exc.field}: {exc.message}" if exc.field else exc.message) from None
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(f"is not JSON ({exc.msg} at character {exc.pos}); write an object like "
                                        '{"name": "digits"}') from None
        if not isinstance(parsed, dict):
            raise forms.ValidationError("must be a JSON object ({...})")
        return parsed

    def prepare_value(self, value: Any) -> Any:
        return json.dumps(value) if isinstance(value, dict) else value


class ReplicasField(forms.CharField):
    """Replicas per stage as REST takes them: a number ("2": `2`) or a range ("1-3": `{"min": 1, "max": 3}`);
    the API's serializer checks the numbers."""

    _RANGE = re.compile(r"(\d{1,6})\s*(?:-\s*(\d{1,6}))?")

    widget = forms.TextInput(attrs={"maxlength": 40, "placeholder": "1"})

    def to_python(self, value: Any) -> int | dict[str, int] | None:
        text = super().to_python(value).strip()
        if not text:
            return None
        match = self._RANGE.fullmatch(text) if len(text) <= 40 else None
        if match is None:
            raise forms.ValidationError(f"{text[:40]!r} is neither a number of replicas (2) nor a range min-max (1-3)")
        low, high = match.groups()
        return int(low) if high is None else {"min": int(low), "max": int(high)}

    def prepare_value(self, value: Any) -> Any:
        return f"{value['min']}-{value['max']}" if isinstance(value, dict) else value


class JobSubmitForm(forms.Form):
    """The fields a browser sends; `api_input()` is the POST /api/jobs body they make."""

    name = forms.CharField(max_length=200, required=False)
    model_config = JsonObjectField(initial=EXAMPLE_MODEL, help_text='e.g. {"type": "mlp", "layer_sizes": [64, 10]}')
    dataset_config = JsonObjectField(initial=EXAMPLE_DATASET, help_text='e.g. {"name": "digits", "batch_size": 32}')
    epochs = forms.IntegerField(initial=1)
    learning_rate = forms.FloatField(initial=0.05)
    micro_batches = forms.IntegerField(initial=2)
    stages = forms.IntegerField(required=False, help_text="empty: all free Ready nodes (up to the layers)")
    checkpoint_interval_steps = forms.IntegerField(
        initial=50, required=False, help_text="save every stage's state every N steps (0: only at the end)"
    )
    schedule = forms.ChoiceField(choices=PipelineSchedule.choices, initial=PipelineSchedule.GPIPE)
    replicas = ReplicasField(
        required=False,
        help_text="replicas per stage, each on its own node: a number (2), or min-max (1-3) to add replicas while "
        "Ready nodes have room; empty: 1",
    )
    replica_sync = JsonObjectField(
        required=False,
        help_text='with replicas: empty or {"every_steps": 1} sums gradients every step (equal to one process); '
        '{"every_steps": 16, "outer_lr": 0.7, "outer_momentum": 0.9} averages weight deltas every 16 (DiLoCo)',
    )
    owner_diversity = forms.BooleanField(
        required=False, initial=True,
        help_text="no single owner's nodes hold every stage (no contributor receives the whole model)",
    )
    start = forms.BooleanField(required=False, initial=True, help_text="queue it for training at once")

    def api_input(self) -> dict[str, Any]:
        """Fields left empty take the API's defaults; owner diversity unticked opts out of it."""
        data = {k: v for k, v in self.cleaned_data.items() if k not in ("start", "owner_diversity") and v is not None}
        if not self.cleaned_data.get("owner_diversity"):
            data["requirements"] = {"owner_diversity": False}
        return data


class NodeControlsForm(forms.Form):
    """The owner's controls, as PUT /api/nodes/<id>/controls takes them."""

    work_windows = forms.CharField(max_length=1000, required=False, help_text='UTC, comma-separated: "22:00-07:00"')
    idle_only = forms.BooleanField(required=False)
    idle_cpu_threshold = forms.FloatField(initial=0.5)
    max_memory_bytes = forms.IntegerField(required=False)
    max_threads = forms.IntegerField(required=False)

    def api_input(self) -> dict[str, Any]:
        data = dict(self.cleaned_data)
        data["work_windows"] = [w.strip() for w in data["work_windows"].split(",") if w.strip()]
        return data
