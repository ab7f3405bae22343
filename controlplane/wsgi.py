"""The Django WSGI application (`runserver`; the web server runs it in its threads: controlplane/asgi.py)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

application = get_wsgi_application()

from controlplane.common.startup import refuse_development_secret  # noqa: E402 (needs the app loaded)

refuse_development_secret()
