import os
import sys

# Before torch loads libgomp, which reads it once. Stages that share a machine hand cores to each other
# several times a step (nodeagent.lending); after a parallel region an idle OpenMP thread spins for
# GOMP_SPINCOUNT iterations (300k by default, milliseconds) on the core a neighbouring stage has just
# taken back. 10k keeps the wake-up between one action's regions fast and frees the core in well under
# a millisecond (bench/pipeline_vs_torch.py). An explicit setting wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from nodeagent.cli import main  # noqa: E402

sys.exit(main())
