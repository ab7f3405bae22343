"""WSGI entry point (`gunicorn controlplane.wsgi`)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

django_application = get_wsgi_application()

from controlplane.common.startup import refuse_development_secret  # noqa: E402 (needs the app loaded)
from controlplane.nodes.heartbeat import quiet_heartbeats  # noqa: E402

# Quiet heartbeats (nothing changed) are answered before Django: controlplane/nodes/heartbeat.py.
application = quiet_heartbeats(django_application)

refuse_development_secret()
