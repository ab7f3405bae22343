import sys

from nodeagent.openmp import cap_openmp_spin

cap_openmp_spin()  # before nodeagent.cli imports torch

from nodeagent.cli import main  # noqa: E402

sys.exit(main())
