"""A job generation's data-plane credentials (arceus.contracts.credentials), minted under a key derived from
SECRET_KEY: the assignments the agents are sent, the driver (a Celery worker) and the sampler (the web
process) agree on every token without storing one, and a new generation's tokens are new."""

from __future__ import annotations

from collections.abc import Sequence

from django.utils.crypto import salted_hmac

from arceus.contracts.credentials import DRIVER, StageCredentials, mint_token, stage_credentials

_SALT = "arceus.data-plane-credentials"


def _secret() -> bytes:
    return salted_hmac(_SALT, "mint", algorithm="sha256").digest()


def job_driver_token(*, job_id: str, generation: int) -> str:
    """What the control plane presents when it calls the job's stages (driving, checkpoints, audits, sampling)."""
    return mint_token(_secret(), str(job_id), generation, DRIVER)


def job_stage_credentials(
    *, job_id: str, generation: int, stage_index: int, rank: int, ranks: Sequence[int], replica: int | None = None,
    tied: Sequence[int] = (),
) -> StageCredentials:
    """The credentials sent to the agent of rank `rank` of stage `stage_index` (`ranks`: each stage's rank count;
    `replica`: its replica id in a replicated stage, which accepts its siblings and holds its own replica token;
    `tied`: the stages it shares tied weights with, whose ranks it accepts)."""
    return stage_credentials(_secret(), str(job_id), generation, stage_index, rank, ranks, replica=replica, tied=tied)
