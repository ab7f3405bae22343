"""The node agents' API: registration, heartbeats (the quiet ones answered before Django), leaving, and a job's
files. It reads the stages and assignments of jobs, so it sits above jobs (and below the market; no models)."""
