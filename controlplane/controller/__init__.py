"""The controller: the only code that changes a job's placement, generation and status.

Level-triggered reconciliation (`snapshot` reads into `views`, `rules` decide purely on them and return `actions`,
`executor` applies them with optimistic checks), job status transitions (`transitions`), placement in the solver's
terms (`placement`) and rollbacks (`rollback`). Services elsewhere record intent or facts and nudge it.
"""
