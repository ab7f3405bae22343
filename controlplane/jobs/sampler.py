"""Text sampled through the agents that hold a job's stages (`arceus.training.sampling`), run by the training
worker (the task `arceus.sample`): this loads torch and dials agents, which the web server never does. It holds
token ids, never the model; the API's checks and its wait are `controlplane.jobs.sampling`'s."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from django.conf import settings

from arceus.data.text_config import dataset_tokenizer
from arceus.training.sampling import SamplingError, sample_through_pipeline
from controlplane.jobs.credentials import job_driver_token
from controlplane.jobs.models import Job
from controlplane.jobs.selectors import job_stage_endpoints


def job_sample_through_agents(
    *, job_id: str, prompt: str, length: int, temperature: float, seed: int
) -> dict[str, Any]:
    """{"text": the prompt and its continuation}, or {"status", "message"} of the error the API answers with."""
    job = Job.objects.filter(pk=job_id).first()
    if job is None:
        return {"status": HTTPStatus.NOT_FOUND, "message": f"job {job_id} not found"}
    try:
        text = sample_through_pipeline(
            job_stage_endpoints(job=job),
            job_id=str(job.id),
            generation=job.generation,
            credential=job_driver_token(job_id=str(job.id), generation=job.generation),
            model_config=job.model_config,
            tokenizer=dataset_tokenizer(job.dataset_config),
            prompt=prompt,
            length=length,
            temperature=temperature,
            seed=seed,
            timeout=settings.ARCEUS_RPC_TIMEOUT_SECONDS,
        )
    except ValueError as exc:  # the text file changed since submission: another vocabulary size
        return {"status": HTTPStatus.CONFLICT, "message": f"cannot sample from job {job.id}: {exc}"}
    except SamplingError as exc:  # a stage moved or its agent went away meanwhile: worth trying again
        return {"status": HTTPStatus.SERVICE_UNAVAILABLE, "message": f"sampling job {job.id} failed: {exc}; try again"}
    return {"text": text}
