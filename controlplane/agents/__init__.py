"""The agent-facing API that serves and receives a job's files (checkpoints, uploaded initial weights, an exported
model's program): it reads job state, so it sits above jobs (and below the market; no models). The agents'
registration, heartbeat and leave are still `controlplane/nodes/api.py`."""
