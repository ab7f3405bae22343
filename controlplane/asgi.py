"""The web server's application (`gunicorn controlplane.asgi -c python:controlplane.gunicorn_conf`): quiet
heartbeats answered on the event loop (controlplane/agents/heartbeat.py), every other request handed to Django's
WSGI application in a pool of ARCEUS_WEB_THREADS threads (a2wsgi: the request body streamed to the thread, the
answer streamed back), each thread keeping its database connection between requests."""

import os

from a2wsgi import WSGIMiddleware

from controlplane.wsgi import application as django_application  # loads Django: first

# isort: split
from controlplane.agents.heartbeat import quiet_heartbeats

THREADS = int(os.environ.get("ARCEUS_WEB_THREADS", "8"))

application = quiet_heartbeats(WSGIMiddleware(django_application, workers=THREADS))
