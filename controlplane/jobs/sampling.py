"""Text from a trained transformer job: its newest checkpoint's weights, sampled in this process."""

from __future__ import annotations

from dataclasses import dataclass

from arceus.data.text import text_vocabulary
from arceus.errors import SpecError
from arceus.model.generate import sample_text
from arceus.model.gpt_spec import GPTSpec
from arceus.model.spec import model_spec_from_config
from controlplane.common.errors import ApplicationError
from controlplane.jobs.checkpoints import job_model_weights
from controlplane.jobs.models import Job


@dataclass(frozen=True)
class JobSample:
    text: str  # the prompt followed by the sampled characters
    step: int  # the training step of the checkpoint sampled from


def job_sample(*, job: Job, prompt: str, length: int, temperature: float, seed: int) -> JobSample:
    """Continue `prompt` by `length` characters (temperature 0: always the likeliest one). The vocabulary is
    the characters of the job's training text, as it was when the job was submitted."""
    if not isinstance(model_spec_from_config(job.model_config), GPTSpec):
        raise ApplicationError.conflict(f"job {job.id} trains an MLP; only a transformer job generates text")
    weights, checkpoint = job_model_weights(job=job)
    try:
        vocabulary = text_vocabulary(job.dataset_config)
    except SpecError as exc:
        raise ApplicationError.conflict(f"job {job.id}'s training text is gone: {exc.message}") from exc
    unknown = sorted(set(prompt) - set(vocabulary))
    if unknown:
        raise ApplicationError.invalid(
            "prompt", f"uses {''.join(unknown)!r}, which the training text never does; its characters: {vocabulary!r}"
        )
    try:
        text = sample_text(
            job.model_config, weights, vocabulary, prompt=prompt, length=length, temperature=temperature, seed=seed
        )
    except ValueError as exc:  # the text file changed since submission: another vocabulary
        raise ApplicationError.conflict(f"cannot sample from job {job.id}: {exc}") from exc
    return JobSample(text=text, step=checkpoint.step)
