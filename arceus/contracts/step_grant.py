"""How an agent refuses a train step beyond its job's step grant (controlplane/jobs/step_grant.py), so that the
driver tells that stop from a stage's fault: the status FAILED_PRECONDITION, its message beginning `NOT_GRANTED`."""

from __future__ import annotations

NOT_GRANTED = "step not granted:"
CODE = "FAILED_PRECONDITION"  # a grpc.StatusCode's name (this layer imports no grpc)


def not_granted_message(*, job_id: str, step: int, grant: int | None, waited_seconds: float) -> str:
    granted = "no step granted yet" if grant is None else f"the step grant is {grant}"
    return (f"{NOT_GRANTED} train step {step} of job {job_id} is beyond what the control plane granted ({granted}; "
            f"waited {waited_seconds:.1f} s for a heartbeat reply to extend it)")


def is_not_granted(code: str | None, message: str) -> bool:
    """Whether a call's status (`code`: its name) is an agent's refusal of a step beyond its grant."""
    return code == CODE and message.startswith(NOT_GRANTED)
