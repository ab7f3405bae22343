"""Text from a trained transformer job: its newest checkpoint's weights, sampled in this process."""

from __future__ import annotations

from dataclasses import dataclass

from arceus.data.text import dataset_tokenizer
from arceus.errors import SpecError
from arceus.model.generate import sample_text
from arceus.model.registry import architecture_of, model_spec_from_config, text_writers
from controlplane.common.errors import ApplicationError
from controlplane.jobs.checkpoints import job_model_weights
from controlplane.jobs.models import Job


@dataclass(frozen=True)
class JobSample:
    text: str  # the prompt followed by the sampled tokens' text
    step: int  # the training step of the checkpoint sampled from


def job_sample(*, job: Job, prompt: str, length: int, temperature: float, seed: int) -> JobSample:
    """Continue `prompt` by `length` tokens (temperature 0: always the likeliest one), with the tokenizer of
    the job's training text (its characters, or the BPE trained on it)."""
    spec = model_spec_from_config(job.model_config)
    if not architecture_of(spec).writes_text:
        raise ApplicationError.conflict(
            f"job {job.id} trains a model of type {spec.type!r}; only a {' or '.join(text_writers())} job "
            "generates text"
        )
    weights, checkpoint = job_model_weights(job=job)
    try:
        tokenizer = dataset_tokenizer(job.dataset_config)
    except SpecError as exc:
        raise ApplicationError.conflict(f"job {job.id}'s training text is gone: {exc.message}") from exc
    if unknown := tokenizer.unknown(prompt):
        raise ApplicationError.invalid(
            "prompt", f"uses {unknown!r}, which the training text never does; its characters: "
            f"{tokenizer.decode(list(range(tokenizer.vocab_size)))!r}",
        )
    try:
        text = sample_text(
            job.model_config, weights, tokenizer, prompt=prompt, length=length, temperature=temperature, seed=seed
        )
    except ValueError as exc:  # the text file changed since submission: another vocabulary size
        raise ApplicationError.conflict(f"cannot sample from job {job.id}: {exc}") from exc
    return JobSample(text=text, step=checkpoint.step)
