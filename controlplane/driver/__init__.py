"""The control plane's side of a job's training driver: running it (`driving`: the plan from the database, the
lease renewer), its progress sink (`sink`) and the recording of its progress, counters and last word (`progress`),
which bills the work and stores spot checks; so it sits above jobs and the market and below the controller."""
