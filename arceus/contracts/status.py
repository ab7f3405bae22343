"""A job's status, as the control plane keeps it, its reconciler plans on it, and the SDK and the CLI read it
from the API."""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    CREATED = "created"  # submitted, not started
    QUEUED = "queued"  # waiting for the reconciler to place it
    PLACING = "placing"  # stages assigned; waiting for every agent to report them ready
    PENDING = "pending"  # a stage lost its node and no Ready node has room for it yet
    RUNNING = "running"  # a training driver runs it
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


ACTIVE_STATUSES = (JobStatus.PLACING, JobStatus.PENDING, JobStatus.RUNNING)  # the job holds nodes
HOSTED_STATUSES = (JobStatus.PLACING, JobStatus.RUNNING)  # agents host its stages (pending: not all placed)
TERMINAL_STATUSES = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)
STARTABLE_STATUSES = (JobStatus.CREATED, JobStatus.FAILED, JobStatus.CANCELLED)
