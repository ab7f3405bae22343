"""Text from a transformer job, sampled through the agents that hold its stages: checked here, then sampled by
the training worker (`controlplane.jobs.sampler`, which loads torch and dials the agents) while the request waits,
at most ARCEUS_SAMPLE_TIMEOUT_SECONDS."""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus

from django.conf import settings

from arceus.contracts.status import JobStatus
from arceus.data.text_config import dataset_tokenizer
from arceus.errors import SpecError
from arceus.model.registry import architecture_of, model_spec_from_config, text_writers
from controlplane.celery import SAMPLE_TASK
from controlplane.common.conditions import TRUE, get_condition
from controlplane.common.dispatch import task_result
from controlplane.common.errors import ApplicationError
from controlplane.jobs.models import Job


@dataclass(frozen=True)
class JobSample:
    text: str  # the prompt followed by the sampled tokens' text
    step: int  # the training step the agents' weights had reached when sampling began


def job_sample(*, job: Job, prompt: str, length: int, temperature: float, seed: int) -> JobSample:
    """Continue `prompt` by `length` tokens (temperature 0: always the likeliest one) with the weights the
    job's agents hold now, and the tokenizer of the job's training text (its characters, or the BPE trained
    on it). The agents hold the stages while the job runs, and while a succeeded job is served
    (`controlplane/jobs/serving.py`); a tensor-parallel stage decodes only when served (whole, on one agent)."""
    spec = model_spec_from_config(job.model_config)
    if not architecture_of(spec).writes_text:
        raise ApplicationError.conflict(
            f"job {job.id} trains a model of type {spec.type!r}; only a {' or '.join(text_writers())} job "
            "generates text"
        )
    _check_hosted(job)
    try:
        tokenizer = dataset_tokenizer(job.dataset_config)
    except SpecError as exc:
        raise ApplicationError.conflict(f"job {job.id}'s training text is gone: {exc.message}") from exc
    if unknown := tokenizer.unknown(prompt):
        raise ApplicationError.invalid(
            "prompt", f"uses {unknown!r}, which the training text never does; its characters: "
            f"{tokenizer.decode(list(range(tokenizer.vocab_size)))!r}",
        )
    step = job.step
    timeout = settings.ARCEUS_SAMPLE_TIMEOUT_SECONDS
    outcome = task_result(
        SAMPLE_TASK, timeout=timeout, job_id=str(job.id), prompt=prompt, length=length, temperature=temperature,
        seed=seed,
    )
    if outcome is None:
        raise ApplicationError(
            f"sampling job {job.id}: no training worker answered within {timeout:.0f}s (all busy, or none running); "
            "try again",
            status=HTTPStatus.SERVICE_UNAVAILABLE,
        )
    if "text" not in outcome:
        raise ApplicationError(outcome["message"], status=outcome["status"])
    return JobSample(text=outcome["text"], step=step)


def _check_hosted(job: Job) -> None:
    """409, saying what to do, unless agents hold every stage of the job whole for decoding now."""
    if job.status == JobStatus.RUNNING:
        if job.tensor_parallel:
            raise ApplicationError.conflict(
                f"job {job.id} trains tensor-parallel stages, whose ranks do not decode for samplers; once it "
                "succeeded, serve it (POST /api/jobs/<id>/serve: each stage whole on one agent) and sample it then"
            )
        return
    if job.status == JobStatus.SUCCEEDED:
        if not job.serving:
            raise ApplicationError.conflict(
                f"job {job.id} succeeded and is not served: serve it (POST /api/jobs/<id>/serve), then sample it once "
                "its Serving condition is True; or download the model (GET /api/jobs/<id>/model)"
            )
        serving = get_condition(job.conditions, "Serving")
        if serving is None or serving["status"] != TRUE:
            state = f"{serving['reason']}: {serving['message']}" if serving else "not placed yet"
            raise ApplicationError.conflict(
                f"job {job.id} is being served but its stages are not ready ({state}); try again once its Serving "
                "condition is True"
            )
        return
    raise ApplicationError.conflict(
        f"job {job.id} is {job.status}: its model is sampled through the agents that hold its stages, which "
        "they do while it runs and while a succeeded job is served; sample it then, or download the model "
        "(GET /api/jobs/<id>/model)"
    )
