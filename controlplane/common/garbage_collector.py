"""The cyclic garbage collector of a long-running control-plane process, tuned so that it does not pause it: the web
server's workers (controlplane/gunicorn_conf.py), the Celery pool processes (controlplane/celery.py), and the
scale bench's load generator (bench/control_plane_scale.py), each once its code is loaded.

What lives as long as the process (Django, its apps, the URL and serializer machinery: about 385,000 objects once
loaded) leaves the collector's view (`gc.freeze`), so no collection scans it again. And a young collection waits
for 50,000 new objects instead of 700.

Measured, each with the default collector against this one:
- Web: each request through Django leaves about 160 objects in reference cycles (request, view, parsers,
  serializers), and at 700 a request's objects were promoted to the old generation while it still ran, so only
  full collections freed them. In one `bench/control_plane_scale.py` run, 54 full collections each paused a
  worker's event loop (holding 5,000 agents) for 0.3-1.1 s, which was the heartbeats' p99; the freeze alone left
  0.3 s pauses. In-process, 12,000 heartbeats (a tenth through Django, 120,000 long-lived objects made
  meanwhile): 984 collections, 503 ms in all, longest 96 ms by default; 10, 237 ms, longest 28 ms tuned.
- Control worker: a reconcile pass over 10,000 nodes makes about 200,000 objects, and every second pass ran a full
  collection of the worker's heap (0.20-0.23 s, of a 0.17 s pass). Tuned, 12 passes ran no collection over 0.01 s
  and the passes took 0.165-0.183 s instead of 0.17-0.40 s (the pass placing 10 jobs a pass, every lease renewed).
- The load generator: with Django loaded, a full collection stopped its loop for up to 325 ms, timed as the
  server's latency.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000


def garbage_collector_tuned() -> None:
    """Freeze what the process holds now and raise the young generation's threshold (the module's docstring)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, 20, 100)
