"""Development tools, not shipped: the local cluster behind `make demo` and the end-to-end tests, agent
launchers and static pipelines for tests and benchmarks, the single-process reference run, and the link
shaper."""
