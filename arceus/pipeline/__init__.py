"""Pipeline schedules as data: which forward/backward actions each stage runs, in which order."""
