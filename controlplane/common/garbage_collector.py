"""The cyclic garbage collector of a long-running control-plane process, tuned so that it does not pause it: the web
server's workers (controlplane/gunicorn_conf.py), the Celery pool processes (controlplane/celery.py), and the
scale bench's load generator (bench/control_plane_scale.py), each once its code is loaded.

What lives as long as the process (Django, its apps, the URL and serializer machinery) leaves the collector's view
(`gc.freeze`), so no collection scans it again; and a young collection waits for 50,000 new objects instead of 700,
so a request's or a reconcile pass's short-lived cycles die young instead of being promoted and freed only by full
collections that pause the event loop. Measurements: docs/BENCHMARKS.md ("The tuned garbage collector").
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000


def garbage_collector_tuned() -> None:
    """Freeze what the process holds now and raise the young generation's threshold (the module's docstring)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, 20, 100)
